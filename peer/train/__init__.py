"""The training side of a peer: model, tokenizer, data sources, the inner loop, the outer updates and export.
Pure torch and data code, shared with the simulator; it imports neither the transport nor the swarm."""
