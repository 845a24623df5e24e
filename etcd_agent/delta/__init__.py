"""Continuous backups: delta segments between full backups, and point-in-time restore.

The watcher, segment format and replay engine (not yet wired into the daemon and the CLI).

- ``proto``     protobuf wire codec of the etcd messages used here (pure)
- ``rpc``       the gRPC transport (Watch stream, KV Txn/Range, Lease RPCs); the one grpc importer
- ``segments``  the segment file format: its records as typed values, file names, a dir's segments
- ``segwriter`` writing one segment, made visible whole (file I/O)
- ``segreader`` the bounded reader of one segment, checked end to end (file I/O)
- ``segchain``  the chain check: segments followed from a full backup, where the chain stops
- ``leases``    the lease rule of a restore, as a pure function of the captured lease records
- ``watcher``   ``DeltaWatcher``: a watch on the local member written into segments
- ``watchevents`` what the watch delivers as whole revisions: decoded, fragments reassembled (pure)
- ``scratch``   a throwaway single-member etcd on loopback, restored from a snapshot
- ``leftovers`` what a killed drill or replay left: its dirs, and the scratch etcd still running in them
- ``replay``    a replay's target, its plan (where it stops, from a checked chain) and its result
- ``replayrun`` the replay carried out: a chain onto a full snapshot in a scratch etcd; a new snapshot out
"""
