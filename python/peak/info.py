"""``python -m peak.info``: what this installation of peak was built with."""
import platform
import sys

import torch


def collect() -> dict:
    import peak

    facts = dict(peak._C.build_info())
    levels = peak._C.cpu_levels()
    # The level of the CPU kernels this process runs (NOTE: [CPU levels]), and why.
    facts["cpu_level"] = levels["active"] + (
        f" (forced by PEAK_CPU_LEVEL={levels['forced']})" if levels["forced"]
        else " (the best this CPU runs)" if len(levels["compiled"]) > 1
        else " (the only one built)")
    facts.update(cpu_levels_supported=",".join(levels["supported"]),
                 torch_version_running=torch.__version__, cuda_available=torch.cuda.is_available(),
                 python=sys.version.split()[0], machine=platform.machine())
    return facts


def main() -> None:
    facts = collect()
    width = max(len(k) for k in facts)
    for key, value in facts.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
