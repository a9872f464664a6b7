"""Bytes between two peers: the p2pd byte channel, parallel lanes, tensor encoding, the pairwise exchange and the
state download for joiners."""
