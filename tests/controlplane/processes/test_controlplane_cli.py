"""``fairbatching-controlplane`` / ``python -m controlplane``: help, exit codes, and status and
ranks against a daemon started by ``serve``.

(Named apart from tests/sim/test_cli.py: test folders have no __init__.py, so basenames must differ.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import zmq

from benchmarks.controlplane.live_daemon import loopback_config, start_process_daemon
from benchmarks.support.paths import REPO
from benchmarks.support.ports import free_ports
from controlplane import protocol as p
from controlplane.cli import main
from controlplane.client import Client
from controlplane.errors import DaemonUnavailable


def cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controlplane", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def unused_address() -> str:
    return loopback_config().client_address


def test_help_documents_every_command_and_the_exit_codes() -> None:
    top = cli("--help")
    assert top.returncode == 0
    for text in ("serve", "status", "ranks", "exit codes", "daemon unreachable"):
        assert text in top.stdout


@pytest.mark.parametrize(("command", "expected"), [("serve", "--config"), ("status", "--timeout"),
                                                   ("ranks", "sequence gaps")])
def test_each_subcommand_has_help(command: str, expected: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as caught:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert caught.value.code == 0 and "exit codes" in out and expected in out
    assert f"fairbatching-controlplane {command}" in out


@pytest.mark.parametrize("argv", [[], ["bogus"], ["status", "--timeout", "0"], ["ranks", "--timeout", "x"],
                                  ["status", "--address", "not-an-address"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    assert code == 2 and "error" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such config file"),
    ("[daemon\n", "invalid TOML"),
    ("[daemon]\nbogus = 1\n", "bogus"),
    ('[daemon]\nclient_address = "tcp://10.1.2.3:5560"\n', "not loopback"),
])
def test_serve_with_a_bad_config_exits_2_with_one_line(tmp_path, content: str | None, message: str) -> None:
    path = tmp_path / "daemon.toml"
    if content is not None:
        path.write_text(content)
    run = cli("serve", "--config", str(path))
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1 and message in run.stderr


def test_an_unreachable_daemon_exits_3() -> None:
    started = time.monotonic()
    run = cli("status", "--address", unused_address(), "--timeout", "0.3")
    assert run.returncode == 3 and "no reply" in run.stderr
    assert time.monotonic() - started < 10
    assert main(["ranks", "--address", unused_address(), "--timeout", "0.2", "--json"]) == 3


def test_status_and_ranks_of_a_served_daemon(tmp_path, capsys: pytest.CaptureFixture) -> None:
    config = loopback_config(stale_after_s=30.0, lost_after_s=60.0, daemon_id="cli-daemon")
    running = start_process_daemon(tmp_path, config)
    agent = zmq.Context.instance().socket(zmq.DEALER)
    reports = zmq.Context.instance().socket(zmq.PUSH)
    try:
        agent.setsockopt(zmq.ROUTING_ID, b"agent-x")
        for sock, address in ((agent, config.rank_address), (reports, config.report_address)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        agent.send(p.encode(p.Hello("agent-x", "rank-x", 4, protocol=p.PROTOCOL_VERSION)))
        assert agent.poll(5000) and isinstance(p.daemon_to_agent_channel().decode(agent.recv()), p.Welcome)
        reports.send(p.encode(p.Report("rank-x", 4, 1, 1234.0, 2, 3, 0, 100, 0, 0.01, 0.0)))
        classes = {"tight": p.ClassBudget(0.5, 300.0), "loose": p.ClassBudget(8.0, 9000.0)}
        reports.send(p.encode(p.Report("rank-x", 4, 3, 1500.0, 2, 3, 0, 100, 0, 0.01, 0.0, classes)))  # one lost

        address = ["--address", config.client_address]
        deadline = time.monotonic() + 5
        while True:  # the reports travel on their own socket
            assert main(["ranks", *address, "--json"]) == 0
            (rank,) = json.loads(capsys.readouterr().out)
            if rank["reported_pab_tokens"] == 1500.0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (rank["rank"], rank["agent"], rank["epoch"], rank["seq_gaps"]) == ("rank-x", "agent-x", 4, 1)
        assert rank["class_budgets"] == {"tight": 300.0, "loose": 9000.0}

        assert main(["ranks", *address]) == 0
        header, row = capsys.readouterr().out.splitlines()
        assert header.split("  ")[0] == "rank" and "seq gaps" in header and "report age" in header
        assert row.split()[:6] == ["rank-x", "agent-x", "4", "1500", "1500", "2"]
        assert header.endswith("class budgets") and row.endswith("loose=9000,tight=300")

        assert main(["status", *address]) == 0
        text = capsys.readouterr().out
        for line in ("daemon     cli-daemon", "policy     pab", "draining   no", "in flight  0",
                     "ranks      1 (0 stale)", "counters"):
            assert line in text

        run = cli("status", *address, "--json")
        assert run.returncode == 0
        status = json.loads(run.stdout)
        assert status["daemon_id"] == "cli-daemon" and status["counters"]["ranks_joined"] == 1
    finally:
        agent.close()
        reports.close()
        code = running.terminate()
    assert code == 0  # SIGTERM drains and exits 0


def test_drain_wait_resume_and_an_unknown_rank(tmp_path, capsys: pytest.CaptureFixture) -> None:
    config = loopback_config(stale_after_s=30.0, lost_after_s=60.0)
    running = start_process_daemon(tmp_path, config)
    agent = zmq.Context.instance().socket(zmq.DEALER)
    reports = zmq.Context.instance().socket(zmq.PUSH)
    client = zmq.Context.instance().socket(zmq.DEALER)
    replies = p.client_reply_channel()
    try:
        agent.setsockopt(zmq.ROUTING_ID, b"agent-d")
        for sock, address in ((agent, config.rank_address), (reports, config.report_address),
                              (client, config.client_address)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        agent.send(p.encode(p.Hello("agent-d", "rank-d", 4, protocol=p.PROTOCOL_VERSION)))
        assert agent.poll(5000) and isinstance(p.daemon_to_agent_channel().decode(agent.recv()), p.Welcome)
        reports.send(p.encode(p.Report("rank-d", 4, 1, 50_000.0, 0, 0, 0, 100_000, 0, 0.01, 0.0)))
        time.sleep(0.2)
        client.send(p.encode(p.Submit("held", p.Prompt(token_ids=[1, 2, 3]), protocol=p.PROTOCOL_VERSION)))
        assert client.poll(5000) and isinstance(replies.decode(client.recv()), p.Dispatched)
        dispatch = p.daemon_to_agent_channel().decode(agent.recv())
        address = ["--address", config.client_address]

        assert main(["drain", "rank-d", *address, "--wait", "--wait-timeout", "0.5"]) == 5
        captured = capsys.readouterr()
        assert "rank rank-d: draining, 1 in flight" in captured.out and "still in flight" in captured.err

        client.send(p.encode(p.Submit("refused", p.Prompt(token_ids=[1]), protocol=p.PROTOCOL_VERSION)))
        assert client.poll(5000)
        reject = replies.decode(client.recv())
        assert (reject.request_id, reject.reason, reject.retryable) == ("refused", p.RejectReason.NO_RANKS, True)

        agent.send(p.encode(p.Done("rank-d", 4, "held", p.FinishReason.LENGTH, 3, 1,
                                   dispatch_seq=dispatch.dispatch_seq)))
        assert client.poll(5000) and isinstance(replies.decode(client.recv()), p.Finish)
        run = cli("drain", "rank-d", *address, "--wait")
        assert run.returncode == 0 and "rank rank-d: drained" in run.stdout

        assert main(["ranks", *address]) == 0
        header, row = capsys.readouterr().out.splitlines()
        assert row.split()[header.split().index("draining") - 2] == "yes"  # "PAB" headers are two words

        assert main(["resume", "rank-d", *address]) == 0
        assert "rank rank-d: resumed, 0 in flight" in capsys.readouterr().out
        client.send(p.encode(p.Submit("again", p.Prompt(token_ids=[1]), protocol=p.PROTOCOL_VERSION)))
        assert client.poll(5000) and isinstance(replies.decode(client.recv()), p.Dispatched)

        assert main(["drain", "nope", *address]) == 4
        assert "no rank named 'nope'" in capsys.readouterr().err
    finally:
        for sock in (agent, reports, client):
            sock.close()
        running.kill()


def test_gateway_usage_errors_exit_2(tmp_path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "empty-key"
    empty.write_text("\n")
    for argv, message in ((["--listen", "0.0.0.0:8000"], "not loopback"),
                          (["--listen", "nowhere"], "HOST:PORT"),
                          (["--api-key-file", str(empty)], "is empty"),
                          (["--api-key-file", str(tmp_path / "missing")], "No such file"),
                          (["--curve-server-key", "x"], "go together")):
        assert main(["gateway", *argv]) == 2
        assert message in capsys.readouterr().err


def test_gateway_says_where_it_listens_and_serves_until_sigterm(tmp_path) -> None:
    import signal
    import urllib.request

    config = loopback_config()
    daemon = start_process_daemon(tmp_path, config)
    (port,) = free_ports(1)
    gateway = subprocess.Popen([sys.executable, "-m", "controlplane", "gateway", "--daemon", config.client_address,
                                "--listen", f"127.0.0.1:{port}", "--model", "m"], cwd=REPO,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
                    listed = json.loads(response.read())
                break
            except OSError:
                assert time.monotonic() < deadline and gateway.poll() is None, gateway.stderr.read()
                time.sleep(0.1)
        assert [m["id"] for m in listed["data"]] == ["m"]
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(10) == 0
        said = gateway.stderr.read().splitlines()
        assert said[0] == f"gateway listening on http://127.0.0.1:{port} (model m, daemon {config.client_address})"
        assert sum("listening" in line for line in said) == 1, said
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait(10)
        daemon.kill()


def test_serve_http_usage_errors_exit_2(capsys: pytest.CaptureFixture, tmp_path) -> None:
    bad_hints = tmp_path / "hints.toml"
    bad_hints.write_text('service_tier = { turbo = "interactive" }\n')
    for argv, message in ((["--model", "m"], "--model only apply with --http"),
                          (["--slo-hints", str(bad_hints)], "--slo-hints only apply with --http"),
                          (["--http", "127.0.0.1:8000", "--slo-hints", str(bad_hints)],
                           f"{bad_hints}: service_tier: unknown tier(s) ['turbo']"),
                          (["--http", "127.0.0.1:8000", "--slo-hints", str(tmp_path / "none.toml")],
                           "none.toml: No such file or directory"),
                          (["--max-in-flight", "3", "--allow-non-loopback"],
                           "--max-in-flight, --allow-non-loopback only apply with --http"),
                          (["--http", "0.0.0.0:8000"], "--http '0.0.0.0:8000' is not loopback"),
                          (["--http", "nowhere"], "--http 'nowhere': expected HOST:PORT")):
        assert main(["serve", *argv]) == 2
        assert message in capsys.readouterr().err


def test_serve_http_is_the_daemon_and_its_gateway_in_one_process_and_drains_on_sigterm(tmp_path) -> None:
    """One process serves HTTP and the daemon's sockets; SIGTERM lets a stream in flight
    finish, then it exits 0."""
    import http.client
    import signal

    from benchmarks.controlplane.live_daemon import write_config

    config = loopback_config()
    (port,) = free_ports(1)
    served = subprocess.Popen([sys.executable, "-m", "controlplane", "serve", "--config",
                               str(write_config(tmp_path / "daemon.toml", config)), "--http", f"127.0.0.1:{port}",
                               "--model", "m"], cwd=REPO, stderr=subprocess.PIPE, text=True)
    rank = subprocess.Popen([sys.executable, "-m", "sglang_ext.sim.rank", "--daemon", config.rank_address,
                             "--agent-id", "one", "--log-level", "warning"], cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        with Client(config.client_address) as client:  # the daemon's socket, served beside HTTP
            while True:
                try:
                    if [rank for rank in client.status().ranks if not rank.stale]:
                        break
                except DaemonUnavailable:  # still starting: a busy machine can take seconds
                    pass
                assert time.monotonic() < deadline and served.poll() is None, "the rank never joined"
                time.sleep(0.2)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", "/v1/completions", json.dumps(
            {"prompt": [7] * 16, "max_tokens": 150, "ignore_eos": True, "stream": True}))
        response = connection.getresponse()
        assert response.status == 200
        first = response.readline()
        assert first.startswith(b"data: ")
        served.send_signal(signal.SIGTERM)
        rest = response.read().decode()
        assert served.wait(30) == 0
        said = served.stderr.read()
    finally:
        for process in (rank, served):
            if process.poll() is None:
                process.kill()
                process.wait(10)
    chunks = [json.loads(line.removeprefix("data: ")) for line in (first.decode() + rest).split("\n\n")
              if line.startswith("data: {")]
    assert rest.rstrip().endswith("data: [DONE]")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(chunk["choices"][0]["text"] == " tok" for chunk in chunks) == 150
    listening = [line for line in said.splitlines() if "listening" in line]
    expected = (f"gateway listening on http://127.0.0.1:{port} (model m, daemon in-process "
                f"(clients at {config.client_address}))")
    assert listening == [expected]
    (draining,) = [json.loads(line) for line in said.splitlines() if '"draining"' in line]
    assert draining["in_flight"] == 1  # the stream was still running when SIGTERM came
    assert '"daemon stopped"' in said

