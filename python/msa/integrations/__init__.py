"""Integrations of msa with other libraries (each one imported on its own, so that msa does not
depend on them): ``msa.integrations.transformers`` runs MiniMax-M3's sparse layers in Hugging
Face transformers through msa."""
