"""etcd's protobuf messages, generated from its own .proto files (see README.md)."""
