"""Where models come from: names to files. The built-in names (wheels.py), Hugging Face
repositories through huggingface_hub (hub.py, download.py), the stores other tools keep
(stores.py: the hub's cache, Ollama, LM Studio), each model's summary from its header
(summary.py) and the quant a repository's file names give (quants.py); resolve.py joins
them. Knows files, never tensors: no torch is imported here."""
