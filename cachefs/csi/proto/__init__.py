r"""The CSI spec's protocol (csi.proto, v1.12.0) and the Python modules protoc generated from it.

Regenerate after replacing csi.proto (from the repository root, with the dev extra installed):

    python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. \
        cachefs/csi/proto/csi.proto

tests/unit/csi/test_proto.py fails when the committed modules differ from what that makes.
"""
