"""Generated gRPC stubs for the rlfleet.v1 protos (scripts/gen_proto.py)."""
