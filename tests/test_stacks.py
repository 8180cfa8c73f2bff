"""benchmarks/stacks.py: one thread's py-spy samples under a frame, charged to the runtime's frames."""

from __future__ import annotations

RAW = """\
thread (11): MainThread;main (profile_fetch.py:400);measure_served (profile_fetch.py:320);_load (/x/zipmoe/runtime/engine/loader.py:50) 40
thread (11): MainThread;main (profile_fetch.py:400);measure_served (profile_fetch.py:330);_timed (profile_fetch.py:130);Fetcher._run (/x/zipmoe/runtime/engine/fetcher.py:300);Fetcher._admit (/x/zipmoe/runtime/engine/fetcher.py:310);ExpertCache.offer (/x/zipmoe/runtime/engine/cache.py:250);copy_ (/x/site-packages/torch/_tensor.py:9) 7
thread (11): MainThread;main (profile_fetch.py:400);measure_served (profile_fetch.py:330);_timed (profile_fetch.py:130);Fetcher._run (/x/zipmoe/runtime/engine/fetcher.py:290) 3
thread (12): worker-1;Thread.run (threading.py:1);_decode_chunk (/x/zipmoe/runtime/engine/decoder.py:125) 50
thread (11): MainThread;main (profile_fetch.py:400);_timed (profile_fetch.py:130);Fetcher._run (/x/zipmoe/runtime/engine/fetcher.py:300) 9
not a stack line
"""


def test_samples_of_one_thread_under_a_frame_path_are_charged_to_the_runtime_frame_that_made_them(bench_script):
    st = bench_script("stacks")
    t = st.tally(st.parse(RAW.splitlines(), "MainThread", "measure_served/_timed"))
    # the load (not under _timed), the worker and the pass outside measure_served are left out
    assert t["total"] == 10
    assert t["owner"]["ExpertCache.offer (runtime/engine/cache.py)"] == 7  # torch's copy_ charged to its caller
    assert t["owner"]["Fetcher._run (runtime/engine/fetcher.py)"] == 3
    assert t["self"]["copy_ (torch/_tensor.py)"] == 7
    assert t["inclusive"]["Fetcher._run (runtime/engine/fetcher.py)"] == 10
    every = st.tally(st.parse(RAW.splitlines(), None, None))
    assert every["total"] == 109


def test_a_file_without_the_thread_says_so_in_one_line(bench_script, tmp_path, capsys):
    st = bench_script("stacks")
    f = tmp_path / "s.txt"
    f.write_text(RAW)
    assert st.main([str(f), "--thread", "nobody"]) == 1
    assert "no samples of thread 'nobody'" in capsys.readouterr().err
    assert st.main([str(tmp_path / "missing.txt")]) == 1
    (tmp_path / "bad.txt.gz").write_text("not gzip")
    assert st.main([str(tmp_path / "bad.txt.gz")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_gzipped_samples_read_as_they_are_kept_in_results(bench_script, tmp_path, capsys):
    import gzip

    st = bench_script("stacks")
    f = tmp_path / "s.txt.gz"
    with gzip.open(f, "wt") as fh:
        fh.write(RAW)
    plain = tmp_path / "s.txt"
    plain.write_text(RAW)
    assert st.main([str(f)]) == 0
    gz_out = capsys.readouterr().out
    assert st.main([str(plain)]) == 0
    assert capsys.readouterr().out == gz_out and "samples of thread 'MainThread'" in gz_out
