"""The node's data plane: the HTTP app the API and edge call (dataplane) and its grant gate
(grant_check)."""
