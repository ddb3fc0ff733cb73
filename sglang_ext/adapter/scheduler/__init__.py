"""FairBatching inside SGLang's own scheduler: the adapter from SGLang's objects to the
pure policy core (``sglang_ext.policy``) and back. The only package besides
``sglang_ext.adapter.emulated_gpu`` and ``sglang_ext.adapter.dp_pab`` that imports sglang."""
