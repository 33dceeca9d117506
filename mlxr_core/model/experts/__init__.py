"""Expert weights streamed from the checkpoint files (``models[].experts.residency: stream``).

A mixture of experts runs ``top_k`` of its experts per token; the rest of its expert weights sit
idle. Under streaming, every other weight is resident while the experts stay where the checkpoint
keeps them (safetensors or GGUF, packed as stored): the format leaves them unread
(:class:`~mlxr_core.model.checkpoint.LeavesTensors`), and each MoE layer's stacked experts are a
:class:`~mlxr_core.model.experts.layer.StreamedExperts` that asks the model's
:class:`~mlxr_core.model.experts.store.ExpertStore` for the experts its tokens route to. The store
reads them with ``os.pread`` at their byte offsets, on a pool of threads, into a cache of a fixed
number of bytes (:mod:`~mlxr_core.model.experts.cache`), and reads ahead the experts the next
layer will likely need. :mod:`~mlxr_core.model.experts.wiring` finds, through the architecture's
own ``sanitize``, which stored tensor holds which expert of which layer.
"""
