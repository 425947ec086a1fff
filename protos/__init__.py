"""gRPC contracts between Crescent's services: the .proto files and their generated stubs."""
