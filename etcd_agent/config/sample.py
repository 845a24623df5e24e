"""The commented sample config (``etcd-agent config sample``; also shipped as conf/agent.toml)."""

SAMPLE = """\
# /etc/etcd-agent/agent.toml - etcd-agent configuration.
# The same file goes on every master. Check it with: etcd-agent config validate
# Every key below shows its default; uncomment to change it.

[cluster]
name = "k8s-etcd"
# Token of a *new* cluster (static bootstrap, restore). Letters, digits, _ . -
token = "k8s-etcd-1"
# "static": every member starts at once with the full --initial-cluster (state=new).
# "incremental": the first member starts alone, the others `member add` + start one at a time.
bootstrap = "static"
# Joins add a member as a non-voting learner first and promote it once it has caught up.
# learner_joins = false

# One [[member]] per master. client_url / peer_url default to http(s)://host:2379 / :2380
# (https when [tls] is set); ssh_host defaults to host.
[[member]]
name = "master1"
host = "10.0.0.11"

[[member]]
name = "master2"
host = "10.0.0.12"

[[member]]
name = "master3"
host = "10.0.0.13"
# client_url = "https://10.0.0.13:2379"
# peer_url = "https://10.0.0.13:2380"
# ssh_host = "master3.example.internal"

[local]
# Which member this machine is. Default: the member whose name or host matches this machine's
# host name or one of its IP addresses.
# name = "master1"

[etcd]
# binary = "/usr/bin/etcd"
# etcdctl = "/usr/bin/etcdctl"
# etcdutl = "/usr/bin/etcdutl"        # etcd >= 3.5: offline snapshot status/restore
# data_dir = "/var/lib/etcd/default.etcd"
# conf_file = "/etc/etcd/etcd.conf"
# unit = "etcd.service"
# unit_file = "/etc/systemd/system/etcd.service"
# user = "etcd"
# group = "etcd"
# service_manager = "systemd"         # or "process": the agent runs etcd itself
# client_port = 2379
# peer_port = 2380
# start_timeout = 60.0
# versions_dir = "/opt/etcd"          # releases side by side: <versions_dir>/<version>/{etcd,etcdctl,etcdutl}

[tls]
# Client TLS (https client URLs, --client-cert-auth) and peer TLS. Set all three of a kind.
# client_ca = "/etc/etcd/pki/ca.crt"
# client_cert = "/etc/etcd/pki/server.crt"
# client_key = "/etc/etcd/pki/server.key"
# client_cert_auth = true
# peer_ca = "/etc/etcd/pki/ca.crt"
# peer_cert = "/etc/etcd/pki/peer.crt"
# peer_key = "/etc/etcd/pki/peer.key"
# peer_client_cert_auth = true

[backup]
# dir = "/var/lib/etcd_backup"       # created 0700; backups are 0600 (they hold every Secret);
#                                     # an existing dir must already be 0700 and the agent's own
# keep_last = 7                       # the newest N always stay
# keep_hourly = 24                    # plus the newest of each of the last N hours
# keep_daily = 7                      # plus the newest of each of the last N days
# compression = "none"                # or "zstd": .tar.zst
# utc = true                          # file names in UTC
# space_margin = 0.2                  # free space needed: expected size x (1 + margin)
# metrics_file = "/var/lib/node_exporter/textfile_collector/etcd_agent_backup.prom"
#                                     # node_exporter textfile: last success time, size, failures
# manifest_key = "/etc/etcd-agent/manifest.key"
#                                     # the key that signs manifests and delta segments (default:
#                                     # manifest.key beside this file; the cluster shares it through
#                                     # etcd). Keep a copy OFF the masters: a restore on new hosts
#                                     # checks signatures with it (restore --from-bucket --key-file)
# encrypt_to = []                     # age recipients, e.g. ["age1...", "age1..."] (at most 20; public
#                                     # keys: `age-keygen -y KEYFILE` prints one): the snapshot is
#                                     # encrypted as it streams, the masters never hold the key; restore,
#                                     # backup verify and import then take --identity KEYFILE. Written
#                                     # uncompressed (compression must stay "none"); delta segments
#                                     # are encrypted to them too (.seg.age)

[backup.remote]
# An off-host copy of every backup in S3-compatible storage (AWS S3, MinIO, Ceph RGW, Aliyun OSS),
# uploaded and verified after each backup, with its own retention.
# enabled = false
# endpoint = "https://minio.example.internal:9000"   # none: AWS in `region`
# bucket = "etcd-backups"
# prefix = "etcd-backup/{cluster}/{host}/"  # one folder per master: their copies never collide
# region = "us-east-1"
# credentials_file = "/etc/etcd-agent/s3-credentials"  # AWS-style INI, mode 0600
#                                     # (or access_key / secret_key here: then chmod 600 this file)
# credentials_profile = "default"
# addressing_style = "auto"           # "path" for MinIO/Ceph RGW, "virtual" for OSS
# verify = "auto"                     # the strongest check the store is found to enforce (a probe,
#                                     # once per endpoint): SHA-256 checksums, else Content-MD5 and
#                                     # the MD5 ETag (Ceph RGW), else a read-back; "checksum" (or the
#                                     # copy fails), "etag", "download"
# connect_timeout = 5.0               # seconds; a hung gateway fails a request within
# read_timeout = 10.0                 # max_attempts x (connect_timeout + read_timeout + 1) + backoff
# max_attempts = 3
# deadline = 120.0                    # one object, retries included: this plus 1 s a MiB of it
# keep_last = 7
# keep_daily = 30
# Delta segments are uploaded as they close, verified the same way, and pruned with their chain
# (under <prefix>delta-<full backup revision>/).

[backup.delta]
# Continuous backup: the daemon (`etcd-agent run`) watches its member from the newest full backup
# on this host and writes every change into delta segments beside the full backups
# (etcd-delta-<first rev>-<last rev>-<UTC end time>.seg, 0600; .seg.age, encrypted, with
# encrypt_to), so `restore --to-time` / `--to newest` loses seconds, not the time since the last
# cron backup. A full backup and the segments that continue it are kept and pruned together.
# enabled = true
# close_seconds = 5.0                 # a segment with events is closed this often (the data at risk)
# close_bytes = 4194304               # ... or once it holds this much
# batch_seconds = 1.0                 # the watch is read in batches this often (~20x less CPU than
#                                     # streaming; --to-time is exact to this); 0: a streaming watch
# idle_seconds = 60.0                 # an empty segment this often when nothing changes
# max_chain_events = 600000           # past any of these the daemon takes a full backup and
# max_chain_bytes = 1073741824        # starts a new chain: a restore replays at most this much
# max_chain_segments = 1000           # (events replay at ~100,000/s: 600000 is about 6 s)
# checkpoint_ratio = 0.5              # a checkpoint (a full backup inside the chain, which goes on)
#                                     # each time the chain grows by this x the full backup's size:
#                                     # a point-in-time restore replays only what follows the newest
#                                     # one, whatever the chain's length; 0: none
# checkpoint_min_seconds = 60.0       # at most one checkpoint this often
# checkpoint_keep = 2                 # the newest of each chain kept (they take no retention slot)
# lean_checkpoints = true             # a checkpoint's snapshot defragmented offline before it is
#                                     # archived (staged under [daemon] state_dir, twice its size
#                                     # free there): a replay starts from the data, not free pages
# point_in_time_load = "scratch"      # how a point-in-time restore reaches its target: "scratch"
#                                     # replays the chain in a throwaway etcd before anything is
#                                     # touched; "members" restores the start snapshot (checkpoint
#                                     # or full backup) and writes the chain into the restored
#                                     # cluster while the apiservers are still fenced; "auto":
#                                     # members when [kubernetes] fence is not "none"
# max_outage = 300.0                  # member unwatchable this long: chain broken, full backup when back
# metrics_file = "/var/lib/node_exporter/textfile_collector/etcd_agent_delta.prom"
#                                     # default: beside [backup] metrics_file (none when that is unset)

[ssh]
# How restore/upgrade reach the other masters. Host keys are checked against known_hosts only.
# user = "root"
# port = 22
# identity_file = "/root/.ssh/id_ed25519"
# known_hosts = "/etc/etcd-agent/known_hosts"
# connect_timeout = 10.0
# command_timeout = 600.0
# agent_path = "/usr/bin/etcd-agent"
# stream = "auto"                   # the restore's snapshot: "openssh" (the ssh client, ciphers in C
#                                   # beside the agent), "paramiko", or "auto" (openssh when installed)

[kubernetes]
# How restore keeps the apiserver away from etcd: "none", "unit" (stop/start apiserver_unit),
# or "manifest" (move the static-pod manifest to manifest_aside_dir and back).
# fence = "none"
# apiserver_unit = "kube-apiserver.service"
# manifest = "/etc/kubernetes/manifests/kube-apiserver.yaml"
# manifest_aside_dir = "/etc/kubernetes/manifests-aside"
# Each master's apiserver /readyz ({host}: the member's host): set, the restore starts the
# apiservers again one at a time, each once the one before answers 200.
# readyz_url = "https://{host}:6443/readyz"
# readyz_ca = "/etc/kubernetes/pki/ca.crt"
# readyz_timeout = 180.0
# etcd_prefix = "/registry"           # the apiservers' --etcd-prefix
# drop_leader_leases = false          # also drop kube-controller-manager/kube-scheduler leader leases

[daemon]
# interval = 10.0                     # seconds between two convergence cycles
# lock_ttl = 60                       # lease of the cluster-wide membership lock
# state_dir = "/var/lib/etcd-agent"   # remembers that this host has run a member
# metrics_address = "127.0.0.1:9479"  # Prometheus endpoint of the daemon; loopback: it has no auth

[maintenance]
# defrag_threshold_percent = 50.0     # defragment a member when more of its db is free space
# defrag_min_db_bytes = 16777216      # ... and its db is at least this big
# defrag_timeout = 600.0
# auto_defrag = false                 # the daemon defragments its member by itself
# auto_disarm_nospace = false         # the daemon clears a NOSPACE alarm by itself

[drill]
# Restore drills: a backup restored into a throwaway single-member etcd on 127.0.0.1 (its own
# ports and dir, as [etcd] user, at low priority; the live member is never touched), checked
# against the backup, then removed. `etcd-agent drill` runs one now.
# every = 0.0                         # the daemon drills the newest good backup this often, one master
#                                     # at a time (86400 = daily); 0 = never on its own
# dir = "/var/lib/etcd-agent-drill"   # created 0711: the etcd user reaches its own 0700 dir in it;
#                                     # needs room for two copies of the snapshot
# user = ""                           # the throwaway etcd's user; "" = [etcd] user
# nice = 10                           # CPU priority of the drill and its etcd (0-19)
# ionice = "idle"                     # or "best-effort:7", or "none"
# gomaxprocs = 1                      # cores the throwaway etcd may use; 0 = all
# sample_keys = 100                   # keys read back and compared byte for byte with the snapshot file
# timeout = 1800.0                    # a drill that takes longer fails
# metrics_file = "/var/lib/node_exporter/textfile_collector/etcd_agent_drill.prom"
#                                     # node_exporter textfile: last success/failure, duration, failures
"""
