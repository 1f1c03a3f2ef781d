"""``python -m peak.info``: what this installation of peak was built with."""
import platform
import sys

import torch


def collect() -> dict:
    import peak

    facts = dict(peak._C.build_info())
    facts["torch_version_running"] = torch.__version__
    facts["cuda_available"] = torch.cuda.is_available()
    facts["python"] = sys.version.split()[0]
    facts["machine"] = platform.machine()
    return facts


def main() -> None:
    facts = collect()
    width = max(len(k) for k in facts)
    for key, value in facts.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
