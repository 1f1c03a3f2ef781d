"""Print what the build needs to know about the installed torch, one KEY=value per line.

Called by CMakeLists.txt with the Python that pip builds for, so the extension is compiled
against exactly the torch that will import it.
"""
import torch
import torch.utils.cpp_extension as cpp_extension


print(f"TORCH_VERSION={torch.__version__}")
print(f"TORCH_CUDA_VERSION={torch.version.cuda}")
print(f"TORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
print(f"TORCH_INCLUDE_DIRS={'|'.join(cpp_extension.include_paths())}")
print(f"TORCH_LIBRARY_DIR={cpp_extension.library_paths()[0]}")

# The C++ runtime torch runs with (the libstdc++ mapped into this process once torch is loaded):
# the extension links it by path, ahead of the compiler's own (see CMakeLists.txt).
try:
    with open("/proc/self/maps") as maps:
        loaded = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    if len(loaded) == 1:
        print(f"TORCH_LIBSTDCXX={loaded.pop()}")
except OSError:
    pass
