"""Regenerate the Python code of etcd's protocol subset (kv.proto, rpc.proto) here.

    python v3api/proto/generate.py

Needs grpcio-tools, the version pinned in the `test` extra (the one that made the code
here). The generated modules import each other by plain module name; they are rewritten to
import within this package. The runtime versions in
pyproject.toml must admit the versions this generator stamps into the code (it checks
them on import): regenerate, then pin grpcio and protobuf to at least those, and
grpcio-tools in the `test` extra to the version that regenerated it.
"""

from __future__ import annotations

import pathlib
import re
import sys

from grpc_tools import protoc

HERE = pathlib.Path(__file__).resolve().parent


def main() -> int:
    for proto, services in (("kv.proto", False), ("rpc.proto", True)):
        args = ["protoc", f"-I{HERE}", f"--python_out={HERE}", f"--pyi_out={HERE}", *([f"--grpc_python_out={HERE}"] if services else []), str(HERE / proto)]
        if protoc.main(args) != 0:
            print(f"protoc failed on {proto}", file=sys.stderr)
            return 1
    for path in HERE.glob("*_pb2*.py*"):
        text = path.read_text()
        fixed = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        path.write_text(fixed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
