"""Tools on top of the library: reference trainer, benchmark, data, models, anchors (extra: commhooks[tools])."""
