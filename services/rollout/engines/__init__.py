"""A replica's inference engines: the ``Engine`` seam (``base``), the transformers backend
(``hf``), the vLLM backend (``vllm``) and the factory that picks one (``factory``).

Nothing is imported here, so importing a submodule never pulls in torch or vLLM by accident.
"""
