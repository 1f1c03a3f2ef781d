"""peak inside the trainers people already use (docs/integrations.md).

* :mod:`peak.integrations.lightning`: ``Precision`` plugins for Lightning's ``Trainer``:
  ``AmpPrecision`` (Apex dialect: ``amp.initialize`` + ``amp.scale_loss``) and ``MixedPrecision``
  (torch dialect: ``peak.amp.GradScaler`` + ``peak.amp.autocast`` with list edits).
* :mod:`peak.integrations.accelerate`: helpers for Hugging Face Accelerate's ``Accelerator``.

Each submodule imports its framework when imported itself, so ``import peak`` never needs them.
"""
