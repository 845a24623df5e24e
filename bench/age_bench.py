"""Benchmark: age encryption of a snapshot-sized stream, the agent's own code against pyrage
(bindings to the Rust rage) and the `age` binary.

One command. A --size-mb input (default 1200, like the restore bench's snapshot) is written to a
temp dir: 1 MiB blocks alternating random bytes and compressible text (what a Kubernetes db holds
is both), plus an odd tail so the final chunk is short. Each way then encrypts it to one X25519
recipient and decrypts the `age` binary's ciphertext, file to file, in a process of its own:

- `own`: etcd_agent.age (Encryptor / Decryptor, on `cryptography`), fed 1 MiB reads, as
  backup/archive.py and backup/sealed.py feed it
- `pyrage`: pyrage.encrypt_io / decrypt_io on the open files (its streaming API)
- `age`: `age -r` / `age -d -i`, the reference the ratios are against

For each: wall seconds, MB/s of plaintext, CPU seconds, and the process's peak RSS (the kernel's
high-water mark VmHWM, sampled every 10 ms until the exit), beside the RSS of an idle worker that imported the same modules: flat
memory shows as a peak close to that baseline whatever --size-mb. Every decryption's output is
hashed against the input. --rounds interleaves the ways (best of the rounds is printed; the
machine is shared). The temp dir is deleted at the end, also on failure.

    .venv/bin/python bench/age_bench.py [--size-mb 1200] [--rounds 1] [--dir /var/tmp]

pyrage is not an agent dependency (see docs/architecture.md): `.venv/bin/pip install pyrage`
first, or the pyrage rows are skipped with a note.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MB = 1e6
BLOCK = 1 << 20
TAIL = 12_345  # not a multiple of the 64 KiB chunk: the final chunk is a short one


# ---------------------------------------------------------------- the workers (own processes)


def _worker(way: str, op: str, src: str, dst: str, key: str) -> None:
    """One encryption or decryption, file to file; ``op`` "idle" only imports (the baseline RSS)."""
    if way == "own":
        from etcd_agent import age

        if op == "idle":
            return
        with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
            buf = bytearray(BLOCK)
            view = memoryview(buf)
            if op == "encrypt":
                enc = age.Encryptor(age.parse_recipients([key]))
                while n := fin.readinto(buf):
                    fout.write(enc.update(view[:n]))
                fout.write(enc.finish())
            else:
                dec = age.Decryptor(age.load_identities(key))
                while n := fin.readinto(buf):
                    for plain in dec.update(view[:n]):
                        fout.write(plain)
                fout.write(dec.finish())
    elif way == "pyrage":
        import pyrage

        if op == "idle":
            return
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            if op == "encrypt":
                pyrage.encrypt_io(fin, fout, [pyrage.x25519.Recipient.from_str(key)])
            else:
                with open(key) as fh:
                    secret = next(line for line in fh.read().splitlines() if line.startswith("AGE-SECRET-KEY-"))
                pyrage.decrypt_io(fin, fout, [pyrage.x25519.Identity.from_str(secret)])
    else:
        raise SystemExit(f"unknown way {way}")


# ---------------------------------------------------------------- measuring


@dataclass
class Run:
    wall: float
    cpu: float
    rss: int  # kernel's peak RSS of the process, bytes


def hwm(pid: int) -> int:
    """The kernel's RSS high-water mark of ``pid``'s current image (VmHWM), 0 once it is gone.
    Not wait4's ru_maxrss: Linux carries the forking parent's peak across exec into it."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(argv: Sequence[str]) -> Run:
    start = time.monotonic()
    proc = subprocess.Popen(list(argv))
    peak = [0]
    done = threading.Event()

    def sample() -> None:  # VmHWM only grows: its last reading before the exit is the peak
        while not done.wait(0.01):
            peak[0] = max(peak[0], hwm(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _pid, status, usage = os.wait4(proc.pid, 0)
    done.set()
    sampler.join()
    wall = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed with exit code {proc.returncode}")
    return Run(wall, usage.ru_utime + usage.ru_stime, peak[0])


def worker_argv(way: str, op: str, src: str, dst: str, key: str) -> List[str]:
    if way == "age":
        if op == "encrypt":
            return ["age", "-r", key, "-o", dst, src]
        return ["age", "-d", "-i", key, "-o", dst, src]
    return [sys.executable, os.path.abspath(__file__), "--worker", way, op, src, dst, key]


def make_input(path: str, size: int) -> str:
    """``size`` bytes (+ TAIL) of alternating random and compressible 1 MiB blocks; their sha256."""
    h = hashlib.sha256()
    text = b"".join(b'{"kind":"Pod","metadata":{"name":"web-%06d","namespace":"default"}}\n' % i
                    for i in range(20_000))[:BLOCK]
    with open(path, "wb") as fh:
        written, i = 0, 0
        while written < size + TAIL:
            block = os.urandom(BLOCK) if i % 2 == 0 else text
            block = block[: size + TAIL - written]
            fh.write(block)
            h.update(block)
            written += len(block)
            i += 1
    return h.hexdigest()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def have_pyrage() -> bool:
    try:
        import pyrage  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(*sys.argv[2:7])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1200)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where the temp dir goes (default: $TMPDIR)")
    args = ap.parse_args()
    if shutil.which("age") is None or shutil.which("age-keygen") is None:
        raise SystemExit("the age and age-keygen binaries are needed (packaging/install-deps.sh test)")
    ways = ["own", "pyrage", "age"] if have_pyrage() else ["own", "age"]
    if "pyrage" not in ways:
        print("pyrage is not installed: its rows are skipped (.venv/bin/pip install pyrage)")
    tmp = tempfile.mkdtemp(prefix="age-bench-", dir=args.dir)
    try:
        run_all(tmp, args.size_mb * 1_000_000, args.rounds, ways)
    finally:
        shutil.rmtree(tmp)


def run_all(tmp: str, size: int, rounds: int, ways: List[str]) -> None:
    key = os.path.join(tmp, "key.txt")
    subprocess.run(["age-keygen", "-o", key], check=True, capture_output=True)
    recipient = subprocess.run(["age-keygen", "-y", key], check=True, capture_output=True, text=True).stdout.strip()
    plain = os.path.join(tmp, "plain")
    t = time.monotonic()
    digest = make_input(plain, size)
    total = size + TAIL
    print(f"input: {total / MB:.0f} MB (random + compressible) in {time.monotonic() - t:.1f} s, "
          f"sha256 {digest[:16]}...; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    reference = os.path.join(tmp, "reference.age")  # what every way decrypts: the age binary's
    subprocess.run(worker_argv("age", "encrypt", plain, reference, recipient), check=True)
    baseline = {w: measure(worker_argv(w, "idle", plain, os.devnull, key)).rss for w in ways if w != "age"}
    best: Dict[Tuple[str, str], Run] = {}
    for r in range(rounds):
        order = ways[r % len(ways):] + ways[: r % len(ways)]  # rotated: a noisy neighbour hits each alike
        for way in order:
            for op in ("encrypt", "decrypt"):
                out = os.path.join(tmp, f"{way}.{op}")
                argv = worker_argv(way, op, plain if op == "encrypt" else reference, out,
                                   recipient if op == "encrypt" else key)
                run = measure(argv)
                if op == "decrypt" and sha256_file(out) != digest:
                    raise SystemExit(f"{way} decrypted something other than the input")
                if op == "encrypt":
                    check = os.path.join(tmp, "check")  # the age binary must read what each way wrote
                    subprocess.run(worker_argv("age", "decrypt", out, check, key), check=True)
                    if sha256_file(check) != digest:
                        raise SystemExit(f"age -d of {way}'s ciphertext is not the input")
                    os.unlink(check)
                os.unlink(out)
                prev = best.get((way, op))
                if prev is None or run.wall < prev.wall:
                    best[(way, op)] = Run(run.wall, run.cpu, max(run.rss, prev.rss if prev else 0))
        print(f"round {r + 1}/{rounds} done; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(best, baseline, total, ways)


def report(best: Dict[Tuple[str, str], Run], baseline: Dict[str, int], total: int, ways: List[str]) -> None:
    print(f"\n{'way':8} {'op':8} {'wall s':>7} {'MB/s':>7} {'cpu s':>6} {'peak RSS MiB':>13} "
          f"{'idle RSS MiB':>13} {'speed vs age':>13}")
    for op in ("encrypt", "decrypt"):
        ref: Optional[Run] = best.get(("age", op))
        for way in ways:
            run = best[(way, op)]
            idle = baseline.get(way)
            ratio = f"{ref.wall / run.wall:.2f}x" if ref else "-"
            print(f"{way:8} {op:8} {run.wall:7.2f} {total / MB / run.wall:7.0f} {run.cpu:6.2f} "
                  f"{run.rss / 2**20:13.1f} {(f'{idle / 2**20:.1f}' if idle else '-'):>13} {ratio:>13}")


if __name__ == "__main__":
    main()
