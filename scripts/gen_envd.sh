#!/usr/bin/env bash
# Regenerate the envd protocol code (services/nodeagent/envd/proto/*/*_pb.py and *_connect.py) from the
# .proto files beside it. The generators live in a throwaway virtual environment: they are needed only
# when a .proto changes, never at run time. Their versions match the runtime pins in pyproject.toml
# (protobuf-py 0.6.x, connectrpc 0.12.x).
set -euo pipefail
cd "$(dirname "$0")/.."
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools"
"$tools/bin/pip" install -q --disable-pip-version-check grpcio-tools "protoc-gen-py==0.6.0" "protoc-gen-connectrpc==0.12.1"
protos=services/nodeagent/envd/proto
wkt="$("$tools/bin/python" -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')"
"$tools/bin/python" -m grpc_tools.protoc -I"$protos" -I"$wkt" \
  --plugin=protoc-gen-py="$tools/bin/protoc-gen-py" --plugin=protoc-gen-connectrpc="$tools/bin/protoc-gen-connectrpc" \
  --py_out="$protos" --connectrpc_out="$protos" process/process.proto filesystem/filesystem.proto
echo "regenerated $protos"
