"""The C core's primitives with a Python face, public and callable directly:
the wire conversion kernels (kernels: bf16/fp16 casts, the 8-bit block
quantizer) and the peer graphs of gossip averaging (gossip: fairscale's
graphs and mixing for SGP). Above the runtime, below the engines that use
them; `mpidp.kernels` and `mpidp.gossip` are these modules."""
