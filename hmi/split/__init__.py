"""Private tenants by split execution (Symbiosis): the server runs only the root's frozen layers
for many clients at once (the PLOT lookups of the lower layers, the linear projections of the
upper layers); each tenant runs everything of its own (adapter, head, the non-linear parts of the
upper layers) on its side and keeps its adapter there.

``wire`` is the binary format of the tensors both sides exchange; the client needs nothing of the
server's heavy parts."""
