"""Generated gRPC code for the specserve.v1 protos (`make proto`); do not edit the *_pb2 files."""
