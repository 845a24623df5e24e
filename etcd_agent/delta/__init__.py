"""Continuous backups: delta segments between full backups, and point-in-time restore.

The watcher, segment format and replay engine (not yet wired into the daemon and the CLI).

- ``proto``     protobuf wire codec of the etcd messages used here (pure)
- ``rpc``       the gRPC transport (Watch stream, KV Txn/Range, Lease RPCs); the one grpc importer
- ``segments``  the segment file format: writer, bounded reader, chain check (pure file I/O)
- ``leases``    the lease rule of a restore, as a pure function of the captured lease records
- ``watcher``   ``DeltaWatcher``: a watch on the local member written into segments
- ``scratch``   a throwaway single-member etcd on loopback, restored from a snapshot
- ``replay``    replay a chain onto a full snapshot up to a target; a new snapshot out
"""
