"""The sandbox operations and the node's loops: the VM registry (registry) and the manager on top of it
(sandboxes); create, delete, suspend/wake; leases, reconciliation, heartbeats, fencing, warm slots, memory
pressure, and the snapshot cadence that yields to API work (apiwork, cadence)."""
