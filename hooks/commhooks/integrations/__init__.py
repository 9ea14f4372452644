"""commhooks inside the trainers people use: Hugging Face Accelerate and Trainer, PyTorch Lightning.

Each is one small module that translates, as the engine adapters do, and needs its framework installed
(the ``commhooks[frameworks]`` extra); nothing here is imported by ``import commhooks``:

* :mod:`commhooks.integrations.accelerate`: one call after ``accelerator.prepare``;
* :mod:`commhooks.integrations.transformers`: ``CommHookCallback(config)`` for ``Trainer``;
* :mod:`commhooks.integrations.lightning`: ``CommHookCallback(config)`` for ``lightning.Trainer``.

What all three keep that the frameworks' own checkpoints do not: between syncs every rank's weights, optimizer
moments and hook state are its own, while the frameworks save rank 0's; so each rank writes its own file beside
the framework's checkpoint (:mod:`commhooks.checkpoint`'s layout, agreed collectively), and a resume from a
checkpoint that lacks them is refused on every rank instead of silently ending with different models.
"""
