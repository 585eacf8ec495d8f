"""A child process that runs one `fabric` command and reports what it imported, and when it reached activation.

Run as `python -c CHILD SITE REPORT [ARGV...]`:

    SITE    put first on sys.path ("" : nothing added)
    REPORT  where the child writes its JSON report
    ARGV    `fabric ARGV...` through reconciler.cli.main; `--import MODULE`
            imports MODULE only; nothing: the interpreter alone

The report: `at_start`, `at_end` (sorted module names when the child began
and ended) and, when the command got to `Applier.run` (a pass that
activates; absent for a memo hit), `at_activation` and `cpu_at_activation`
(time.process_time() then). Applier.run is wrapped when
reconciler.engine.apply is first imported, by a finder first on
sys.meta_path, so the child imports nothing early that the pass would not.

Used by tests/unit/test_pass_imports.py (which modules a pass imports, and
when) and bench/pass_cpu (how many, and the CPU they cost).
"""

CHILD = r"""
import json, sys, time
site, report, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
if site:
    sys.path.insert(0, site)
seen = {"at_start": sorted(sys.modules)}

class MarkActivation:
    def find_spec(self, name, path=None, target=None):
        if name != "reconciler.engine.apply":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            run = module.Applier.run

            def marked(self, *args, **kwargs):
                seen.setdefault("cpu_at_activation", time.process_time())
                seen.setdefault("at_activation", sorted(sys.modules))
                return run(self, *args, **kwargs)

            module.Applier.run = marked

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, MarkActivation())
code = 0
try:
    if argv[:1] == ["--import"]:
        __import__(argv[1])
    elif argv:
        from reconciler.cli import main
        code = main(argv)
finally:
    seen["at_end"] = sorted(sys.modules)
    with open(report, "w") as out:
        json.dump(seen, out)
sys.exit(code)
"""
