"""The sandbox network: taps, addresses and leases (network), the nftables ruleset (netfilter), repair of a
vanished tap (tapwatch), and guest ports behind the API's edge (ports)."""
