"""The peer in its swarm: DHT membership, the network side (DHT, p2p, listings), GASLoC gossip and DiLoCo
averaging rounds, and noticing a long absence."""
