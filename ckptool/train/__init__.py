"""``ckptool train``: the built-in GPT, FSDP2 sharding, data, the loop and the rank launcher.

Modules: ``config`` (TrainConfig), ``sizes`` (ModelConfig, presets; torch-free), ``model``,
``data``, ``parallel`` (mesh, fully_shard, activation checkpointing, checks), ``loop``,
``launch`` (spawns ranks or joins torchrun), ``accelerate_config`` (Accelerate FSDP YAML).
Saving and resuming go through ``ckptool.checkpoint.Checkpointer``. Importing this package
imports nothing heavy.
"""
