"""The test session's shared launches, one after another, in a process of their own (tests/conftest.py Background):
`python tests/launches.py PLAN.json OUT_DIR PID`. PLAN is [[world, [[run dir, [overrides]], ...]], ...]; each launch
is a torchrun of tools/jobs.py's jobs (tests/launch_ranks.py: each inside what its test measures), and when it ends
its result (exit code, output) goes to OUT_DIR/launch<world>.json, written whole (a reader sees no file or a
complete one). The chain drives itself, so whichever pytest worker (or the one pytest process) reads a launch needs
nothing from the one that started it; it stops when PID (the pytest process the session belongs to) is gone, and
kills a launch that runs past its time (a hang fails its tests, not the suite)."""
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def write(path, record):
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def main(plan_path, out_dir, pid):
    from tools import jobs as job_runner
    with open(plan_path) as f:
        plan = json.load(f)
    for world, jobs in plan:
        t0, limit = time.time(), max(600, 60 * len(jobs))
        started = job_runner.start(world, jobs, script=(os.path.join(ROOT, "tests", "launch_ranks.py"),))
        while started.proc.poll() is None:
            if not job_runner.running(pid):  # the session is gone (a ^C, -x): nobody will read this launch
                started.kill()
                return
            if time.time() - t0 > limit:
                started.kill()
                break
            time.sleep(0.2)
        p = started.finish()
        seconds = time.time() - t0
        write(os.path.join(out_dir, f"launch{world}.json"),
              {"returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr, "seconds": seconds,
               "note": "" if p.returncode != -9 or seconds < limit else f"killed after {limit} s"})
        if os.environ.get("JOB_TIMES"):  # where a launch's time goes: JOB_TIMES=FILE pytest ... gets a line per job
            with open(os.environ["JOB_TIMES"], "a") as f:
                f.write(f"launch of {world} ranks, {len(jobs)} jobs: {seconds:.1f} s (beside the other tests)\n")
                f.writelines(line + "\n" for line in p.stdout.splitlines()
                             if line.endswith(tuple(d for d, _ in jobs)) and " s for " in line)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
