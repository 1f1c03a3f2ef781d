"""peak inside the trainers people already use (docs/integrations.md): :mod:`.lightning`
(``Precision`` plugins for Lightning's ``Trainer``, both dialects) and :mod:`.accelerate` (helpers
for Hugging Face Accelerate). Each imports its framework when imported itself, so ``import peak``
never needs them.
"""
