"""Kubernetes-like etcd data: ``/registry/...`` keys with values as kube-apiserver stores them.

kube-apiserver writes protobuf: the 4-byte magic ``k8s\\0`` and a ``runtime.Unknown`` envelope
(apiVersion, kind, the object's own bytes). The objects here are built field by field with the
field numbers of ``k8s.io/api`` ``generated.proto`` (ObjectMeta, PodSpec, ...), with what makes
real ones compress as they do: repeated vocabulary (images, label keys, env names, managed-field
JSON, last-applied-configuration), unique parts (uids, IPs, hashes, timestamps), text (ConfigMap
YAML, PEM certificates) and opaque bytes (service-account tokens, helm releases = base64 of gzip,
Secrets encrypted at rest). About 45% of the writes are new revisions of live objects (status
updates, lease renewals), as an etcd keyspace between two compactions holds them.

Used by the benchmarks to fill a real etcd (``fill``); compression figures are only worth
something on such data, never on random bytes. Deterministic for a seed.
"""
from __future__ import annotations

import base64
import json
import multiprocessing
import random
import time
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from etcd_agent.etcd.pb import rpc_pb2

# ---------------------------------------------------------------- protobuf wire format


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [_encode_varint(n) for n in range(1 << 14)]  # tags and most lengths: generating is the fill's cost


def _varint(n: int) -> bytes:
    return _SMALL[n] if n < 16384 else _encode_varint(n)


def ld(num: int, data: bytes) -> bytes:
    """A length-delimited field (message, bytes, string)."""
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def s(num: int, text: str) -> bytes:
    return ld(num, text.encode())


def i(num: int, n: int) -> bytes:
    return _varint(num << 3) + _varint(n)


def kv_map(num: int, m: Dict[str, str]) -> bytes:
    """A ``map<string, string>`` field (go-protobuf writes entries sorted by key)."""
    return b"".join(ld(num, s(1, k) + s(2, v)) for k, v in sorted(m.items()))


def when(num: int, seconds: int) -> bytes:
    """A ``metav1.Time`` (seconds only, as the apiserver stores it)."""
    return ld(num, i(1, seconds))


# ---------------------------------------------------------------- vocabulary

TEAMS = ("platform", "payments", "search", "identity", "data", "edge", "observability", "ml")
APPS = ("api", "web", "worker", "scheduler", "gateway", "cache", "indexer", "auth", "billing", "notifier",
        "ingest", "exporter", "reconciler", "frontend", "checkout", "ledger", "session", "thumbnailer")
SYSTEM_NS = ("default", "kube-system", "kube-public", "kube-node-lease", "monitoring", "logging", "ingress",
             "cert-manager", "argocd")
NAMESPACES = SYSTEM_NS + tuple(f"{t}-{env}" for t in TEAMS for env in ("prod", "stage", "dev"))
REGISTRIES = ("registry.k8s.io", "docker.io/library", "quay.io/prometheus", "ghcr.io/example-org",
              "registry.internal.example.net/apps")
ENV_NAMES = ("LOG_LEVEL", "LOG_FORMAT", "HTTP_PORT", "GRPC_PORT", "DATABASE_URL", "REDIS_ADDR", "KAFKA_BROKERS",
             "OTEL_EXPORTER_OTLP_ENDPOINT", "GOMAXPROCS", "GOMEMLIMIT", "JAVA_TOOL_OPTIONS", "FEATURE_FLAGS",
             "POD_NAME", "POD_NAMESPACE", "NODE_NAME", "TZ", "REGION", "CLUSTER_NAME")
ENV_VALUES = ("info", "json", "8080", "9090", "postgres://app@db.{ns}.svc:5432/app?sslmode=require",
              "redis-master.{ns}.svc.cluster.local:6379", "kafka-0.kafka.{ns}:9092,kafka-1.kafka.{ns}:9092",
              "http://otel-collector.monitoring.svc:4317", "2", "900MiB", "-XX:MaxRAMPercentage=75.0",
              "checkout_v2=true,new_search=false", "Europe/Berlin", "eu-central-1", "prod-eu-1")
EVENTS = (("Normal", "Scheduled", "Successfully assigned {ns}/{name} to {node}"),
          ("Normal", "Pulling", 'Pulling image "{image}"'),
          ("Normal", "Pulled", 'Successfully pulled image "{image}" in {ms}ms ({ms}ms including waiting)'),
          ("Normal", "Created", "Created container {c}"),
          ("Normal", "Started", "Started container {c}"),
          ("Warning", "Unhealthy", "Readiness probe failed: Get \"http://{ip}:8080/readyz\": context deadline exceeded"),
          ("Warning", "BackOff", "Back-off restarting failed container {c} in pod {name}_{ns}({uid})"),
          ("Normal", "Killing", "Stopping container {c}"),
          ("Normal", "SuccessfulCreate", "Created pod: {name}"))
MANAGERS = ("kube-controller-manager", "kubelet", "kube-scheduler", "helm", "argocd-controller", "kubectl-client-side-apply")
CONSONANTS = "bcdfghjklmnpqrstvwxz2456789"


class KubeObjects:
    """An endless, seeded stream of ``(key, value)`` writes of a busy cluster with ``nodes`` nodes."""

    # (resource, apiVersion, kind, builder, weight of a new object of this kind)
    KINDS: Sequence[Tuple[str, str, str, str, int]] = (
        ("events", "v1", "Event", "_event", 34),
        ("pods", "v1", "Pod", "_pod", 22),
        ("replicasets", "apps/v1", "ReplicaSet", "_replicaset", 6),
        ("deployments", "apps/v1", "Deployment", "_deployment", 3),
        ("endpointslices", "discovery.k8s.io/v1", "EndpointSlice", "_endpointslice", 7),
        ("configmaps", "v1", "ConfigMap", "_configmap", 9),
        ("secrets", "v1", "Secret", "_secret", 9),
        ("leases", "coordination.k8s.io/v1", "Lease", "_lease", 2),
        ("services/specs", "v1", "Service", "_service", 3),
    )
    UPDATE_SHARE = 0.45
    MAX_LIVE = 40_000

    def __init__(self, seed: int = 1, nodes: int = 60) -> None:
        self.r = random.Random(seed)
        self.nodes = [f"node-{self.r.getrandbits(16):04x}-{k:03d}.compute.internal" for k in range(nodes)]
        self.images = [f"{reg}/{app}:{self._version()}" for reg in REGISTRIES for app in APPS[:10]]
        self.clock = 1_735_000_000
        self.rv = 100_000
        self.live: List[Tuple[bytes, int, str, str, str]] = []  # key, kind index, ns, app, name
        self._weights = [k[4] for k in self.KINDS]

    def __iter__(self) -> Iterator[Tuple[bytes, bytes]]:
        return self

    def __next__(self) -> Tuple[bytes, bytes]:
        r = self.r
        self.rv += 1
        self.clock += r.randint(0, 2)
        if self.live and r.random() < self.UPDATE_SHARE:
            key, kind, ns, app, name = self.live[r.randrange(len(self.live))]
        else:
            kind = r.choices(range(len(self.KINDS)), self._weights)[0]
            resource = self.KINDS[kind][0]
            ns, app = r.choice(NAMESPACES), r.choice(APPS)
            if resource == "leases":
                ns, name = "kube-node-lease", r.choice(self.nodes)
            elif resource == "events":
                name = f"{self._name(app)}.{r.getrandbits(64):016x}"
            else:
                name = self._name(app)
            key = f"/registry/{resource}/{ns}/{name}".encode()
            entry = (key, kind, ns, app, name)
            if len(self.live) < self.MAX_LIVE:
                self.live.append(entry)
            else:
                self.live[r.randrange(self.MAX_LIVE)] = entry
        _res, api, kind_name, builder, _w = self.KINDS[kind]
        raw = getattr(self, builder)(ns, app, name)
        if raw.startswith(b"k8s:enc:"):  # encrypted at rest: the envelope is inside the ciphertext
            return key, raw
        return key, b"k8s\0" + ld(1, s(1, api) + s(2, kind_name)) + ld(2, raw) + s(3, "") + s(4, "")

    # ------------------------------------------------------------ pieces

    def _version(self) -> str:
        r = self.r
        return r.choice((f"v{r.randint(0, 3)}.{r.randint(0, 40)}.{r.randint(0, 9)}", f"{r.getrandbits(28):07x}",
                         f"2024.{r.randint(1, 12):02d}.{r.randint(1, 28):02d}"))

    def _name(self, app: str) -> str:
        r = self.r
        return f"{app}-{r.getrandbits(36):09x}-{''.join(r.choices(CONSONANTS, k=5))}"

    def _uid(self) -> str:
        h = f"{self.r.getrandbits(128):032x}"
        return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-a{h[17:20]}-{h[20:]}"

    def _ip(self, prefix: str = "10.244") -> str:
        return f"{prefix}.{self.r.randint(0, 255)}.{self.r.randint(1, 254)}"

    def _labels(self, app: str, ns: str) -> Dict[str, str]:
        r = self.r
        out = {"app.kubernetes.io/name": app, "app.kubernetes.io/part-of": ns.split("-")[0],
               "app.kubernetes.io/managed-by": r.choice(("Helm", "argocd", "kustomize"))}
        if r.random() < 0.6:
            out["pod-template-hash"] = f"{r.getrandbits(40):010x}"[:10]
        if r.random() < 0.4:
            out["helm.sh/chart"] = f"{app}-{r.randint(0, 4)}.{r.randint(0, 30)}.{r.randint(0, 9)}"
        return out

    def _managed(self, t: int, status: bool) -> bytes:
        r = self.r
        out = b""
        for _ in range(r.randint(1, 3)):
            fields: Dict[str, object] = {"f:metadata": {"f:labels": {".": {}, "f:app.kubernetes.io/name": {}},
                                                        "f:ownerReferences": {".": {}, 'k:{"uid":"%s"}' % self._uid(): {}}}}
            if status:
                fields["f:status"] = {"f:conditions": {f'k:{{"type":"{c}"}}': {".": {}, "f:lastTransitionTime": {},
                                                                                 "f:status": {}, "f:type": {}}
                                                       for c in ("ContainersReady", "Initialized", "Ready")},
                                      "f:containerStatuses": {}, "f:hostIP": {}, "f:phase": {}, "f:podIP": {},
                                      "f:podIPs": {".": {}, f'k:{{"ip":"{self._ip()}"}}': {".": {}, "f:ip": {}}},
                                      "f:startTime": {}}
            else:
                fields["f:spec"] = {"f:replicas": {}, "f:selector": {}, "f:template": {
                    "f:metadata": {"f:labels": {}}, "f:spec": {"f:containers": {'k:{"name":"main"}': {
                        ".": {}, "f:env": {}, "f:image": {}, "f:name": {}, "f:ports": {}, "f:resources": {}}}}}}
            out += ld(17, s(1, r.choice(MANAGERS)) + s(2, "Update") + s(3, "v1") + when(4, t) + s(6, "FieldsV1")
                      + ld(7, ld(1, json.dumps(fields, separators=(",", ":")).encode()))
                      + (s(8, "status") if status else b""))
        return out

    def _meta(self, name: str, ns: str, app: str, t: int, *, owner: Optional[str] = None, applied: bool = False,
              status: bool = False) -> bytes:
        r = self.r
        m = s(1, name) + s(3, ns) + s(5, self._uid()) + s(6, str(self.rv)) + i(7, r.randint(1, 12)) + when(8, t)
        m += kv_map(11, self._labels(app, ns))
        ann: Dict[str, str] = {}
        if applied:
            ann["kubectl.kubernetes.io/last-applied-configuration"] = json.dumps({
                "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns,
                                                                            "labels": self._labels(app, ns)},
                "spec": {"replicas": r.randint(1, 6), "template": {"spec": {"containers": [{
                    "name": "main", "image": r.choice(self.images),
                    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}]}}}}) + "\n"
        if r.random() < 0.3:
            ann["prometheus.io/scrape"], ann["prometheus.io/port"] = "true", str(r.choice((8080, 9090, 9102)))
        if ann:
            m += kv_map(12, ann)
        if owner is not None:
            m += ld(13, s(1, owner) + s(3, self._name(app)) + s(4, self._uid()) + s(5, "apps/v1") + i(6, 1) + i(7, 1))
        return ld(1, m + self._managed(t, status))

    def _container(self, app: str, ns: str) -> bytes:
        r = self.r
        c = s(1, r.choice(("main", app, "sidecar", "envoy"))) + s(2, r.choice(self.images))
        for a in r.sample(("--config=/etc/app/config.yaml", "--listen=:8080", "--metrics=:9090", "--v=2",
                           "--leader-elect=true", "--log-format=json"), 3):
            c += s(4, a)
        c += ld(6, s(1, "http") + i(3, 8080) + s(4, "TCP")) + ld(6, s(1, "metrics") + i(3, 9090) + s(4, "TCP"))
        for _ in range(r.randint(3, 14)):
            c += ld(7, s(1, r.choice(ENV_NAMES)) + s(2, r.choice(ENV_VALUES).format(ns=ns)))
        c += ld(8, ld(1, s(1, "cpu") + ld(2, s(1, r.choice(("500m", "1", "2"))))) +
                ld(2, s(1, "memory") + ld(2, s(1, r.choice(("256Mi", "512Mi", "1Gi"))))))
        c += ld(9, s(1, "config") + i(2, 1) + s(3, "/etc/app"))
        c += ld(9, s(1, f"kube-api-access-{''.join(r.choices(CONSONANTS, k=5))}") + i(2, 1)
                + s(3, "/var/run/secrets/kubernetes.io/serviceaccount"))
        probe = ld(1, ld(2, s(1, "/healthz") + ld(2, i(1, 0) + i(2, 8080)) + s(4, "HTTP"))) + i(2, 5) + i(3, 1) + i(4, 10)
        c += ld(10, probe) + ld(11, probe)
        c += s(13, "/dev/termination-log") + s(14, "IfNotPresent") + s(20, "File")
        return c

    # ------------------------------------------------------------ kinds

    def _pod(self, ns: str, app: str, name: str) -> bytes:
        r = self.r
        t = self.clock - r.randint(0, 86400 * 20)
        spec = b"".join(ld(2, self._container(app, ns)) for _ in range(r.choice((1, 1, 2, 3))))
        spec += s(3, "Always") + i(4, 30) + s(6, "ClusterFirst") + kv_map(7, {"kubernetes.io/os": "linux"})
        spec += s(8, "default") + s(10, r.choice(self.nodes)) + s(19, "default-scheduler")
        for taint in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            spec += ld(22, s(1, taint) + s(2, "Exists") + s(4, "NoExecute") + i(5, 300))
        status = s(1, r.choice(("Running", "Running", "Running", "Pending", "Succeeded")))
        for cond in ("Initialized", "Ready", "ContainersReady", "PodScheduled"):
            status += ld(2, s(1, cond) + s(2, "True") + when(4, t + r.randint(0, 90)))
        host_ip, pod_ip = self._ip("10.0"), self._ip()
        status += s(5, host_ip) + s(6, pod_ip) + when(7, t)
        status += ld(8, s(1, "main") + ld(2, ld(2, when(1, t + 30))) + i(4, 1) + i(5, r.choice((0, 0, 0, 1, 4)))
                     + s(6, r.choice(self.images)) + s(7, f"{r.choice(REGISTRIES)}/app@sha256:{r.getrandbits(256):064x}")
                     + s(8, f"containerd://{r.getrandbits(256):064x}") + i(9, 1))
        status += s(9, "Burstable") + ld(12, s(1, pod_ip)) + ld(13, s(1, host_ip))
        return self._meta(name, ns, app, t, owner="ReplicaSet", status=True) + ld(2, spec) + ld(3, status)

    def _template(self, app: str, ns: str) -> bytes:
        r = self.r
        return ld(1, kv_map(11, self._labels(app, ns))) + ld(2, b"".join(
            ld(2, self._container(app, ns)) for _ in range(r.choice((1, 1, 2)))) + s(3, "Always") + i(4, 30))

    def _replicaset(self, ns: str, app: str, name: str) -> bytes:
        r = self.r
        t = self.clock - r.randint(0, 86400 * 90)
        n = r.randint(1, 6)
        spec = i(1, n) + ld(2, kv_map(1, {"app.kubernetes.io/name": app})) + ld(3, self._template(app, ns))
        return self._meta(name, ns, app, t, owner="Deployment") + ld(2, spec) + ld(3, i(1, n) + i(2, n) + i(3, n) + i(4, n))

    def _deployment(self, ns: str, app: str, name: str) -> bytes:
        r = self.r
        t = self.clock - r.randint(0, 86400 * 200)
        spec = i(1, r.randint(1, 6)) + ld(2, kv_map(1, {"app.kubernetes.io/name": app})) + ld(3, self._template(app, ns))
        spec += ld(4, s(1, "RollingUpdate") + ld(2, ld(1, s(3, "25%")) + ld(2, s(3, "25%")))) + i(6, 10)
        conds = b"".join(ld(6, s(1, c) + s(2, "True") + when(6, t) + when(7, t) + s(4, "NewReplicaSetAvailable")
                            + s(5, f'ReplicaSet "{self._name(app)}" has successfully progressed.'))
                         for c in ("Available", "Progressing"))
        return self._meta(name, ns, app, t, applied=True) + ld(2, spec) + ld(3, i(1, r.randint(1, 40)) + conds)

    def _endpointslice(self, ns: str, app: str, name: str) -> bytes:
        r = self.r
        t = self.clock - r.randint(0, 86400)
        out = self._meta(name, ns, app, t, owner="Service")
        for _ in range(r.randint(1, 24)):
            out += ld(2, s(1, self._ip()) + ld(2, i(1, 1) + i(2, 1) + i(3, 0))
                      + ld(4, s(1, "Pod") + s(2, ns) + s(3, self._name(app)) + s(4, self._uid()))
                      + s(6, r.choice(self.nodes)) + s(7, r.choice(("eu-central-1a", "eu-central-1b", "eu-central-1c"))))
        return out + ld(3, s(1, "http") + s(2, "TCP") + i(3, 8080)) + s(4, "IPv4")

    def _configmap(self, ns: str, app: str, name: str) -> bytes:
        r = self.r
        t = self.clock - r.randint(0, 86400 * 300)
        data: Dict[str, str] = {}
        for k in range(r.randint(1, 3)):
            if r.random() < 0.2:  # a dashboard or an alert-rule file: JSON
                data[f"dashboard-{k}.json"] = json.dumps({"title": f"{app} / {ns}", "panels": [
                    {"id": p, "type": r.choice(("timeseries", "stat", "table")), "title": f"{app} panel {p}",
                     "targets": [{"expr": f'histogram_quantile(0.99, sum(rate(http_request_duration_seconds_bucket'
                                          f'{{namespace="{ns}",app="{app}"}}[5m])) by (le, pod))', "refId": "A"}]}
                    for p in range(r.randint(4, 40))]}, indent=2)
                continue
            lines = [f"# {app} settings, rendered by helm", "server:", f"  port: {r.choice((8080, 8443))}",
                     f"  readTimeout: {r.randint(1, 60)}s", "log:", f"  level: {r.choice(('info', 'debug', 'warn'))}",
                     "database:", f"  host: db-{r.randint(0, 3)}.{ns}.svc.cluster.local", f"  maxConns: {r.randint(5, 200)}"]
            lines += [f"  {r.choice(('feature', 'limit', 'timeout', 'retry'))}_{r.randint(0, 300)}: "
                      f"{r.choice(('true', 'false', str(r.randint(0, 99999)), self._uid()))}"
                      for _ in range(r.randint(4, 150))]
            data[f"{('config', 'app', 'rules')[k]}.yaml"] = "\n".join(lines) + "\n"
        return self._meta(name, ns, app, t) + kv_map(2, data)

    def _pem(self, label: str, n: int) -> bytes:
        body = base64.encodebytes(self.r.randbytes(n)).decode()  # encodebytes wraps at 76
        return f"-----BEGIN {label}-----\n{body}-----END {label}-----\n".encode()

    def _secret(self, ns: str, app: str, name: str) -> bytes:
        r = self.r
        t = self.clock - r.randint(0, 86400 * 300)
        roll = r.random()
        if roll < 0.2:  # encryption at rest (EncryptionConfiguration aescbc): opaque to etcd
            return b"k8s:enc:aescbc:v1:key1:" + self.r.randbytes(r.randint(500, 6000))
        data: Dict[str, bytes] = {}
        if roll < 0.45:
            data["tls.crt"] = self._pem("CERTIFICATE", r.randint(900, 1400)) * r.randint(1, 3)
            data["tls.key"] = self._pem("PRIVATE KEY", 1190)
            kind = "kubernetes.io/tls"
        elif roll < 0.7:
            data["ca.crt"] = self._pem("CERTIFICATE", 1000)
            data["namespace"], data["token"] = ns.encode(), base64.urlsafe_b64encode(self.r.randbytes(600))
            kind = "kubernetes.io/service-account-token"
        elif roll < 0.85:  # a helm release: base64(gzip(release JSON with the rendered manifests))
            manifest = "\n---\n".join(self._configmap(ns, app, name).decode("latin-1") for _ in range(2))
            release = json.dumps({"name": app, "namespace": ns, "version": r.randint(1, 30), "manifest": manifest,
                                  "info": {"status": "deployed", "description": "Upgrade complete"}})
            z = zlib.compressobj(6, zlib.DEFLATED, 31)
            data["release"] = base64.b64encode(z.compress(release.encode()) + z.flush())
            kind = "helm.sh/release.v1"
        else:
            data["username"], data["password"] = app.encode(), base64.b64encode(self.r.randbytes(24))
            data[".dockerconfigjson"] = json.dumps({"auths": {REGISTRIES[-1]: {
                "auth": base64.b64encode(self.r.randbytes(40)).decode()}}}).encode()
            kind = "Opaque"
        body = b"".join(ld(2, s(1, k) + ld(2, v)) for k, v in sorted(data.items()))
        return self._meta(name, ns, app, t) + body + s(3, kind)

    def _event(self, ns: str, app: str, name: str) -> bytes:
        r = self.r
        t = self.clock - r.randint(0, 3600)
        pod = name.rsplit(".", 1)[0]
        kind, reason, text = r.choice(EVENTS)
        msg = text.format(ns=ns, name=pod, node=r.choice(self.nodes), image=r.choice(self.images), c="main",
                          ms=r.randint(200, 90000), ip=self._ip(), uid=self._uid())
        meta = ld(1, s(1, name) + s(3, ns) + s(5, self._uid()) + s(6, str(self.rv)) + when(8, t))
        involved = ld(2, s(1, "Pod") + s(2, ns) + s(3, pod) + s(4, self._uid()) + s(5, "v1") + s(6, str(self.rv - 7))
                      + s(7, "spec.containers{main}"))
        source = ld(5, s(1, r.choice(("kubelet", "default-scheduler", "replicaset-controller"))) + s(2, r.choice(self.nodes)))
        return (meta + involved + s(3, reason) + s(4, msg) + source + when(6, t) + when(7, t + r.randint(0, 600))
                + i(8, r.randint(1, 40)) + s(9, kind) + s(12, "") + s(13, "kubelet") + s(14, r.choice(self.nodes)))

    def _lease(self, ns: str, app: str, name: str) -> bytes:
        r = self.r
        meta = ld(1, s(1, name) + s(3, ns) + s(5, self._uid()) + s(6, str(self.rv)) + when(8, self.clock - 86400 * 30)
                  + ld(13, s(1, "Node") + s(3, name) + s(4, self._uid()) + s(5, "v1")))
        spec = s(1, name) + i(2, 40) + ld(3, i(1, self.clock) + i(2, r.randint(0, 999_999) * 1000)) + i(5, r.randint(0, 9))
        return meta + ld(2, spec)

    def _service(self, ns: str, app: str, name: str) -> bytes:
        r = self.r
        t = self.clock - r.randint(0, 86400 * 200)
        spec = ld(1, s(1, "http") + s(2, "TCP") + i(3, 80) + ld(4, i(1, 1) + s(3, "http")))
        spec += kv_map(2, {"app.kubernetes.io/name": app}) + s(3, self._ip("10.96")) + s(4, "ClusterIP")
        spec += s(16, "None") + s(19, "SingleStack") + s(20, "IPv4")
        return self._meta(name, ns, app, t, applied=r.random() < 0.5) + ld(2, spec) + ld(3, ld(1, b""))


# ---------------------------------------------------------------- filling a real etcd


def txn_of(puts: Sequence[Tuple[bytes, bytes]]) -> bytes:
    """A TxnRequest of these puts (no compares: the success branch runs)."""
    ops = [rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=k, value=v)) for k, v in puts]
    return rpc_pb2.TxnRequest(success=ops).SerializeToString()


def _fill_worker(endpoint: str, seed: int, stop: Any, written: Any, batch_bytes: int, batch_ops: int) -> None:
    """One filling process: builds the next batch while the previous Txn is in flight."""
    import grpc  # the harness talks to etcd directly; the agent's own code goes through etcd/client.py

    objs = KubeObjects(seed)
    with grpc.insecure_channel(endpoint.split("//", 1)[-1], options=[("grpc.max_send_message_length", 4 << 20)]) as ch:
        txn = ch.unary_unary("/etcdserverpb.KV/Txn", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        pending: Any = None
        while not stop.is_set():
            batch: Dict[bytes, bytes] = {}
            size = 0
            while len(batch) < batch_ops and size < batch_bytes:
                key, value = next(objs)
                if key in batch:  # etcd refuses a txn that puts one key twice
                    break
                batch[key] = value
                size += len(key) + len(value)
            if pending is not None:
                pending.result()
            pending = txn.future(txn_of(list(batch.items())), timeout=120)
            with written.get_lock():
                written.value += size
        if pending is not None:
            pending.result()


def fill(
    endpoint: str,
    target_db_bytes: int,
    *,
    db_size: Callable[[], int],
    seed: int = 1,
    workers: int = 2,
    batch_bytes: int = 1 << 20,
    batch_ops: int = 128,
    progress: Optional[Callable[[str], None]] = None,
) -> int:
    """Put Kubernetes-like objects into the etcd at ``endpoint`` (http://host:port) until
    ``db_size()`` reaches ``target_db_bytes``; returns the bytes of keys and values written.

    Batches of puts in one Txn each (within etcd's defaults: 128 ops, 1.5 MiB a request), from
    ``workers`` processes (making the objects is the cost: Python at ~17 MB/s a core), each with
    its own stream of objects."""
    ctx = multiprocessing.get_context("spawn")  # gRPC does not survive fork
    stop = ctx.Event()
    written = ctx.Value("q", 0)
    procs = [ctx.Process(target=_fill_worker, args=(endpoint, seed * 1000 + k, stop, written, batch_bytes, batch_ops),
                         daemon=True) for k in range(workers)]
    started = time.monotonic()
    for p in procs:
        p.start()
    try:
        last = started
        while True:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a fill worker failed (its traceback is above)")
            have = db_size()
            now = time.monotonic()
            if progress is not None and now - last >= 10:
                last = now
                progress(f"filled {have / 1e6:.0f} of {target_db_bytes / 1e6:.0f} MB of db "
                         f"({written.value / 1e6:.0f} MB of keys and values, {now - started:.0f} s)")
            if have >= target_db_bytes:
                break
            time.sleep(0.5)
    finally:
        stop.set()
        for p in procs:
            p.join(180)
            if p.is_alive():
                p.kill()
    return int(written.value)
