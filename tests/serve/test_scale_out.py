"""Scale-out on a local Ray cluster (`ray.init(num_cpus=2)`, tiny models): a batch job over Ray Data gives the same
rows as in-process, a replica killed mid-job loses no row and duplicates none, a Ray Serve deployment of 2 replicas
answers the `openai` client from both, and without Ray every entry point names the extra to install."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from decodekit.api.errors import ConfigError
from decodekit.batch import RayOptions, run_batch
from decodekit.cli import app
from decodekit.recipe import Recipe, load_recipe
from decodekit.serve import ServeOptions
from tests.helpers.batch_cases import mixed_rows, read_jsonl, same, write_jsonl, write_tiny_recipe

REPLICA_TITLE = "MapBatches(BatchReplica)"
"""In the process title of Ray Data's actors that hold a batch job's engines."""


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory) -> Path:
    return write_tiny_recipe(tmp_path_factory.mktemp("ray"), extra="")


@pytest.fixture(scope="module")
def recipe(recipe_path) -> Recipe:
    return load_recipe(recipe_path)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """200 rows of every kind (prompts, chat, seeded sampling, beam search, rows that cannot run)."""
    rows = mixed_rows(200)
    for i, row in enumerate(rows):  # longer answers: a job that takes long enough to be interrupted
        if isinstance(row, dict) and "prompt" in row and "sampling" not in row and "strategy" not in row:
            row["sampling"] = {"max_tokens": 24 + i % 8}
    return write_jsonl(tmp_path_factory.mktemp("data") / "rows.jsonl", rows)


@pytest.fixture(scope="module")
def in_process(recipe, dataset, tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("local") / "out.jsonl"
    run_batch(recipe, dataset, out)
    return read_jsonl(out)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'decodekit[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow  # 24 s; a killed replica's job (below) runs a Ray job in the default run
def test_a_200_row_job_on_2_ray_replicas_gives_the_in_process_rows(ray_cluster, recipe, dataset, in_process,
                                                                  tmp_path):
    out = tmp_path / "out.jsonl"
    summary = run_batch(recipe, dataset, out, ray=RayOptions(replicas=2, batch_size=16))
    rows = read_jsonl(out)
    assert len(rows) == len(in_process) == 200 and summary.written == 200
    assert [r["id"] for r in rows] == [r["id"] for r in in_process]
    assert same(rows, in_process)
    assert summary.errors == sum(r["error"] is not None for r in in_process) > 0


def replica_pids() -> list[int]:
    import psutil

    pids = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if REPLICA_TITLE in " ".join(proc.info["cmdline"] or []):
            pids.append(proc.info["pid"])
    return pids


def test_a_replica_killed_mid_job_loses_no_row_and_duplicates_none(ray_cluster, recipe, dataset, in_process,
                                                                    tmp_path):
    out = tmp_path / "out.jsonl"
    killed: list[int] = []
    seen: list[str] = []

    def on_row(row: dict[str, Any]) -> None:
        seen.append(row["id"])
        if len(seen) == 24 and not killed:  # the first batches are in; the job is mid-way
            pids = replica_pids()
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    summary = run_batch(recipe, dataset, out, ray=RayOptions(replicas=2, batch_size=8), on_row=on_row)
    assert killed, "the job ended before a replica could be killed"
    assert killed[0] not in replica_pids()
    rows = read_jsonl(out)
    ids = [r["id"] for r in rows]
    assert ids == [r["id"] for r in in_process] and len(set(ids)) == len(ids) == summary.written == 200
    assert seen == ids  # the driver got each row once, in order
    assert same(rows, in_process)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_serve_deployment_of_2_replicas_answers_the_openai_client_from_both(ray_cluster, recipe):
    import openai

    from decodekit.serve.ray_serve import REPLICA_HEADER, ReplicaOptions, start, stop

    port = free_port()
    start(recipe, ServeOptions(port=port, api_key="k"), ReplicaOptions(replicas=2))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        prompts = [f"question {i}" for i in range(24)]
        offline = recipe.build_llm().generate(prompts, recipe.params_for({"max_tokens": 8}))

        def ask(i: int) -> tuple[str, str, str]:
            raw = client.completions.with_raw_response.create(model=recipe.model, prompt=prompts[i], max_tokens=8,
                                                              temperature=0)
            return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text, offline[i].text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(24)))
        assert len({replica for replica, _, _ in answers}) == 2  # both replicas answered
        assert all(text == expected for _, text, expected in answers)
        stream = client.chat.completions.create(model=recipe.model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        chat = client.chat.completions.create(model=recipe.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6)
        assert streamed == chat.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model=recipe.model, prompt="x", temperature=-1)
    finally:
        stop()


@pytest.mark.slow  # 43 s; the 2-replica deployment answering the openai client runs in the default run
def test_decodekit_serve_ray_runs_the_deployment_until_sigterm(recipe_path, tmp_path):
    pytest.importorskip("ray")
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "decodekit", "serve", str(recipe_path), "--ray", "--replicas", "2",
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready"):
                break
        assert lines and lines[-1].startswith("ready"), "".join(lines)
        replicas = set()
        for i in range(12):
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                               json={"model": "x" if i == 0 else str(Path(load_recipe(recipe_path).model)),
                                     "prompt": "hi", "max_tokens": 3})
            assert reply.status_code == (404 if i == 0 else 200), reply.text
            replicas.add(reply.headers["x-decodekit-replica"])
        assert len(replicas) == 2
        assert "decodekit_requests_total" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_without_ray_batch_and_serve_name_the_extra_to_install(monkeypatch, recipe, recipe_path, dataset, tmp_path):
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'decodekit\[ray\]'"):
        run_batch(recipe, dataset, tmp_path / "out.jsonl", ray=RayOptions(replicas=2))
    for command in (["batch", str(recipe_path), "-i", str(dataset), "-o", str(tmp_path / "o.jsonl"), "--ray"],
                    ["serve", str(recipe_path), "--ray", "--replicas", "2"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        assert "decodekit[ray]" in result.output
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "o.jsonl").exists()


def test_replica_options_give_a_fixed_count_or_an_autoscaling_config_and_refuse_a_contradiction():
    from decodekit.serve.ray_serve import ReplicaOptions

    fixed = ReplicaOptions(replicas=3, cpus_per_replica=4).deployment_options()
    assert fixed == {"num_replicas": 3, "ray_actor_options": {"num_cpus": 4}, "max_ongoing_requests": 256}
    scaled = ReplicaOptions(min_replicas=0, max_replicas=8, target_ongoing_requests=4).deployment_options()
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 0, "max_replicas": 8, "initial_replicas": 1,
                                            "target_ongoing_requests": 4}
    with pytest.raises(ConfigError, match=r"max_replicas \(2\) must be at least min_replicas \(3\)"):
        ReplicaOptions(min_replicas=3, max_replicas=2).deployment_options()


# ~80 s, nearly all of it Ray Data starting its three jobs (halving the rows saved nothing); CI keeps the replica jobs
# (`test_a_200_row_job_on_2_ray_replicas_gives_the_in_process_rows`, the killed replica) and runs this with -m slow.
@pytest.mark.slow
def test_a_folder_job_reads_and_writes_through_ray_data_and_resumes_from_the_files_there(ray_cluster, recipe,
                                                                                     tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [row for row in mixed_rows(80) if isinstance(row, dict)]
    for i, row in enumerate(rows):
        row.setdefault("id", f"r{i}")
    rows[3].pop("id")  # a row without an id gets the hash of its content
    source = tmp_path / "rows"
    source.mkdir()
    write_jsonl(source / "part-0.jsonl", rows[:40])  # a folder of files, read in parallel
    write_jsonl(source / "part-1.jsonl", rows[40:])
    reference = read_jsonl(_local_job(recipe, rows, tmp_path))
    target = tmp_path / "answers"
    options = RayOptions(replicas=2, batch_size=16, folder_format="parquet")
    summary = run_batch(recipe, source, target, ray=options)
    assert (summary.written, summary.skipped) == (len(rows), 0)
    files = sorted(target.glob("*.parquet"))
    assert len(files) > 1
    got = {r["id"]: r for r in pq.read_table(target).to_pylist()}
    assert len(got) == len(rows)
    by_id = {r["id"]: r for r in reference}
    differ = [(rid, got.get(rid), by_id[rid]) for rid in by_id if rid != "4" and not same(got.get(rid), by_id[rid])]
    assert not differ, differ[:2]  # "4": the row without an id
    no_id = next(r for rid, r in got.items() if rid not in by_id)
    assert no_id["token_ids"] == by_id["4"]["token_ids"]
    files[0].unlink()  # a job that stopped before writing this file
    lost = len(got) - pq.read_table(target).num_rows
    again = run_batch(recipe, source, target, ray=options)
    assert (again.written, again.skipped) == (lost, len(rows) - lost)
    assert sorted(r["id"] for r in pq.read_table(target).to_pylist()) == sorted(got)


def _local_job(recipe: Recipe, rows: list[dict[str, Any]], tmp_path: Path) -> Path:
    out = tmp_path / "local.jsonl"
    run_batch(recipe, write_jsonl(tmp_path / "all.jsonl", rows), out)
    return out
