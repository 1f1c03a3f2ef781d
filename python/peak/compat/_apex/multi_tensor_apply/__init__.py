"""``apex.multi_tensor_apply`` under peak's Apex alias: ``multi_tensor_applier(op, noop_flag,
tensor_lists, *args)`` calls ``op(chunk_size, noop_flag, tensor_lists, *args)``, with the
``amp_C`` ops of peak/compat/_apex/amp_C.py."""


class MultiTensorApply:
    available = True  # peak's kernels are always built (CPU and, where compiled, CUDA)
    warned = False

    def __init__(self, chunk_size):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def check_avail(self):
        return True

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
