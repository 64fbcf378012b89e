#!/usr/bin/env python3
"""The Python client (python/megacpp_client) against a real megacppd.

Prepares a toy dataset with `megacpp data prepare`, starts megacppd on free loopback ports
with a temporary state directory, a bearer token and (where openssl exists) TLS, then through
the client alone: submits two tiny CPU jobs (a dict and JSON text), watches both to their
end, reads their receipts and compares them, and checks the errors a caller sees (no token,
a refused field, an unknown field, an unknown job).

Every wait is a poll against a generous deadline, never a fixed sleep: the test must pass on
a busy 2-core machine. Exit 0 pass, 1 fail, 77 skip.

    client_test.py --bin-dir BUILD/bin --stubs BUILD/python
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_SECONDS = 120
JOB_SECONDS = 600
STOP_SECONDS = 120
STEPS = 8
TOKEN = "python-client-token"

# The harness's small model (tests/daemon/daemon_harness.h): a few steps take seconds.
SMALL_MODEL = {
    "d_model": 32,
    "pattern": "M*",
    "d_intermediate": 32,
    "vocab_size": 257,
    "ssm_cfg": {"d_state": 16, "headdim": 16, "mimo_rank": 2, "chunk_size": 8},
    "attn_cfg": {"num_heads": 2, "rotary_emb_dim": 8},
}


class Failure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


def pseudo_text(seed, words):
    rng = random.Random(seed)
    vocabulary = ["mamba", "state", "space", "model", "token", "layer", "scan", "gate", "the", "a"]
    return " ".join(rng.choice(vocabulary) for _ in range(words)) + "\n"


def run(command, log):
    with open(log, "ab") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    check(result.returncode == 0, f"{' '.join(command)} exited {result.returncode}")


def make_certificate(directory, log):
    """A self-signed certificate for 127.0.0.1, or None without openssl."""
    if shutil.which("openssl") is None:
        print("openssl not found: the daemon serves plaintext gRPC (token only)")
        return None
    key, cert = os.path.join(directory, "daemon.key"), os.path.join(directory, "daemon.pem")
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", key, "-out", cert], log)
    return key, cert


class Daemon:
    def __init__(self, bin_dir, root, security):
        self.root = root
        self.state = os.path.join(root, "state")
        self.log_path = os.path.join(root, "megacppd.log")
        config = {
            "listen_address": "127.0.0.1:0",
            "http_address": "127.0.0.1:0",
            "state_dir": self.state,
            "data_roots": [os.path.join(root, "data")],
            "min_free_bytes": 1 << 20,
            "devices": {"cpu_slots": 2},
            "executor_path": os.path.join(bin_dir, "megacpp-executor"),
            "security": security,
        }
        self.config_path = os.path.join(root, "daemon.json")
        with open(self.config_path, "w") as f:
            json.dump(config, f, indent=2)
        self.binary = os.path.join(bin_dir, "megacppd")
        self.process = None

    def start(self):
        """Starts megacppd; returns its gRPC address once it serves (it writes
        STATE/daemon.json then)."""
        ready_file = os.path.join(self.state, "daemon.json")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [self.binary, "--config", self.config_path], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            code = self.process.poll()
            check(code is None, f"megacppd exited {code} before serving")
            if os.path.exists(ready_file):
                with open(ready_file) as f:
                    return json.load(f)["grpc"]
            time.sleep(0.05)
        raise Failure(f"megacppd did not serve within {STARTUP_SECONDS} s")

    def stop(self):
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise Failure(f"megacppd did not stop within {STOP_SECONDS} s of SIGTERM")

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-20000:]
        except OSError:
            return "(no log)"


def expect_error(call, code, *fragments):
    from megacpp_client import MegacppError

    try:
        call()
    except MegacppError as error:
        check(error.code == code, f"expected {code.name}, got {error}")
        for fragment in fragments:
            check(fragment in error.details, f"'{fragment}' not in the message: {error}")
        return
    raise Failure(f"expected {code.name}, the call succeeded")


def follow(client, job_id):
    """Iterates watch() to the end; returns (events, final state)."""
    events = list(client.watch(job_id, timeout=JOB_SECONDS))
    check(events, f"watch({job_id}) yielded no event")
    return events, events[-1].state


def test_client(client_module, address, root, cert):
    import grpc

    Client = client_module.Client
    token_file = os.path.join(root, "token")
    tls_ca = cert[1] if cert else None

    # Without the token every call but health is refused, and the caller learns why.
    expect_error(lambda: Client(address, token="", tls_ca=tls_ca).status(),
                 grpc.StatusCode.UNAUTHENTICATED)
    client = Client(address, token_file=token_file, tls_ca=tls_ca, timeout=60)
    status = client.status()
    check(any(d["kind"] == "cpu" for d in status["devices"]), f"no cpu device in {status}")

    spec = {
        "name": "python client",
        "config_json": json.dumps(SMALL_MODEL),
        # Relative prefixes, read against base_dir as the CLI reads them against the spec's
        # folder.
        "train_data": "data/toy_train",
        "valid_data": "data/toy_valid",
        "steps": str(STEPS),
        "batch": 2,
        "seqlen": 32,
        "eval_interval": 0,
        "checkpoint_interval": 5,
        "threads": 1,
        "seed": "7",
    }
    # Refusals name the field.
    expect_error(lambda: client.submit(dict(spec, batch=0), base_dir=root),
                 grpc.StatusCode.INVALID_ARGUMENT, "batch")
    try:
        client.submit(dict(spec, batch_size=2), base_dir=root)
        raise Failure("an unknown spec field was accepted")
    except ValueError as error:
        check("batch_size" in str(error), f"the error does not name the field: {error}")
    expect_error(lambda: client.job("no-such-job"), grpc.StatusCode.NOT_FOUND)

    job_a = client.submit(spec, base_dir=root)
    job_b = client.submit(json.dumps(dict(spec, name="python client b")), base_dir=root)
    check(job_a and job_b and job_a != job_b, f"job ids {job_a!r} {job_b!r}")

    for job_id in (job_a, job_b):
        events, final = follow(client, job_id)
        check(final == "succeeded", f"{job_id} ended {final}: {client.job(job_id)['error']}")
        steps = [e.step["step"] for e in events if e.kind == "step"]
        check(steps == list(range(1, STEPS + 1)), f"{job_id}: step events {steps}")
        check(all(e.step["total_steps"] == STEPS for e in events if e.kind == "step"),
              f"{job_id}: total_steps")
        summaries = [e.summary for e in events if e.kind == "summary"]
        check(len(summaries) == 1 and summaries[0]["stop_reason"] == "completed",
              f"{job_id}: summary events {summaries}")
        check(events[-1].final and events[-1].job["id"] == job_id, f"{job_id}: last event")
        check(client.job(job_id)["state"] == "succeeded", f"{job_id}: GetJob after the end")
        print(f"watched {job_id}: {len(events)} events, final {final}")

    # The job's end is published after its receipts are committed: no waiting here.
    receipts = client.receipts(job_a)
    check([s["step"] for s in receipts.steps] == list(range(1, STEPS + 1)),
          f"step receipts {[s['step'] for s in receipts.steps]}")
    check(all(s["job_id"] == job_a and s["loss"] > 0 and s["tokens"] > 0
              for s in receipts.steps), f"step receipts {receipts.steps}")
    check(receipts.summary is not None and receipts.summary["stop_reason"] == "completed",
          f"run summary {receipts.summary}")
    check(receipts.summary["last_step"] == STEPS, f"run summary {receipts.summary}")
    check(receipts.gates and all(g["decision"] == "off" for g in receipts.gates),
          f"gate decisions {receipts.gates}")
    check(receipts.kernels == [], f"a CPU job has no kernel receipts: {receipts.kernels}")

    comparison = client.compare(job_a, job_b)
    verdicts = comparison.verdicts
    check(set(verdicts) == {"step_ms", "tokens_per_s", "flops_per_s", "loss"},
          f"compared metrics {verdicts}")
    allowed = {"faster", "slower", "lower", "higher", "within noise"}
    check(set(verdicts.values()) <= allowed, f"verdicts {verdicts}")
    # Same spec, same seed, same data, one thread: the same losses step for step.
    loss = next(m for m in comparison.metrics if m["metric"] == "loss")
    check(loss["median_a"] == loss["median_b"] and verdicts["loss"] == "within noise",
          f"loss comparison {loss}")
    check(loss["envelope_a"]["count"] > 0, f"loss envelope {loss}")
    expect_error(lambda: client.compare(job_a, "no-such-job"), grpc.StatusCode.NOT_FOUND)
    print(f"compare {job_a} {job_b}: {verdicts}")

    # Leaving a watch early cancels its stream; the daemon keeps serving.
    for _ in client.watch(job_a):
        break
    check(len(client.jobs("succeeded")) == 2, "ListJobs by state")
    client.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--stubs", required=True, help="the generated modules (BUILD/python)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    # The daemon execs the executor by this path, from its own working directory.
    args.bin_dir = os.path.abspath(args.bin_dir)
    if not os.path.exists(os.path.join(args.stubs, "megacpp", "v1", "jobs_pb2_grpc.py")):
        print(f"FAIL: no generated modules under {args.stubs}: build the target megacpp_python")
        return 1
    sys.dont_write_bytecode = True  # no __pycache__ in the source tree
    sys.path[:0] = [os.path.join(SOURCE_DIR, "python"), args.stubs]
    os.environ.pop("MEGACPP_DAEMON", None)
    os.environ.pop("MEGACPP_TOKEN_FILE", None)
    import megacpp_client

    root = tempfile.mkdtemp(prefix="megacpp-python-client-")
    daemon = None
    ok = False
    started = time.monotonic()
    try:
        setup_log = os.path.join(root, "setup.log")
        corpus = os.path.join(root, "corpus")
        os.makedirs(corpus)
        for i in range(8):
            with open(os.path.join(corpus, f"f{i}.txt"), "w") as f:
                f.write(pseudo_text(i, 400))
        run([os.path.join(args.bin_dir, "megacpp"), "data", "prepare", "--input", corpus,
             "--output", os.path.join(root, "data", "toy"), "--valid-fraction", "0.25"], setup_log)
        with open(os.path.join(root, "token"), "w") as f:
            f.write(TOKEN + "\n")
        cert = make_certificate(root, setup_log)
        security = {"token_file": os.path.join(root, "token")}
        if cert:
            security.update({"tls_key_file": cert[0], "tls_cert_file": cert[1]})
        daemon = Daemon(args.bin_dir, root, security)
        address = daemon.start()
        test_client(megacpp_client, address, root, cert)
        code = daemon.stop()
        check(code == 0, f"megacppd exited {code} after SIGTERM")
        ok = True
    except Exception as error:  # every failure prints the daemon's log
        traceback.print_exc()
        print(f"FAIL: {error}")
        if daemon:
            print("megacppd log:\n" + daemon.log())
    finally:
        if daemon:
            try:
                daemon.stop()
            except Failure as error:
                print(f"FAIL: {error}")
                ok = False
        if ok and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")
    print(f"{'PASS' if ok else 'FAIL'} in {time.monotonic() - started:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
