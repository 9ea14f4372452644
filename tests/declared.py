"""The traffic an algorithm declares for a test's model (what its meter must count)."""

import commhooks
from commhooks import registry
from commhooks.algorithms.traffic import Setting


def declared(config, model, world=2, steps=12, rank=0, **setting):
    """:func:`commhooks.registry.declared_traffic` of ``config`` (a dict) for ``model``'s trainable parameters and
    floating buffers, one rank of ``world``."""
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    return registry.declared_traffic(commhooks.load_config(config), Setting.of(
        shapes, world=world, rank=rank, steps=steps, **{"buffers": buffers, "local_world": world, **setting}))
