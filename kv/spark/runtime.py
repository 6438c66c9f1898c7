"""Starting Spark for ledgerkv: which master (Spark's own precedence), --conf settings, a
quiet JVM, one-line errors that keep their cause, and shipping the package to executors.

The master is the first of: an explicit `master` (kv's --master), `spark.master` among the
given settings (--conf), what Spark itself is configured with (PYSPARK_SUBMIT_ARGS'
--master or --conf spark.master, spark-defaults.conf, the MASTER variable — in spark-submit's
order), and local[2] as the last resort.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import threading

from ..errors import KVError

DEFAULT_MASTER = "local[2]"
QUIET_LOG4J = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2-quiet.properties")
# What the driver JVM prints on its own (not through log4j) when it starts: Spark 4 loads
# the Vector API incubator module, and the JVM says so on stderr.
JVM_NOISE = ("WARNING: Using incubator modules",)
# The sub-packages that pyproject.toml's [tool.setuptools.package-dir] maps into kv from
# folders beside it (tests/test_spark.py checks this against pyproject.toml).
MAPPED_PACKAGES = ("raft", "statemachine", "snapshot", "http", "v3api")
PACKAGE_DATA = (".py", ".json", ".typed", ".properties")


# -- configuration ----------------------------------------------------------------------------


def parse_conf(pairs: list[str] | None, flag: str = "--conf") -> dict[str, str]:
    """KEY=VALUE strings as a dict (the last of a key wins, as spark-submit's --conf)."""
    from ..errors import BadRequest

    out = {}
    for p in pairs or []:
        k, eq, v = p.partition("=")
        if not eq or not k.strip():
            raise BadRequest(f"{flag} {p!r}: give KEY=VALUE, e.g. {flag} spark.executor.memory=4g")
        if not k.strip().startswith("spark."):  # (spark-submit ignores it with a warning: a typo would go unseen)
            raise BadRequest(f"{flag} {p!r}: Spark takes only settings whose names start with 'spark.' and would ignore this one (Hadoop's go as spark.hadoop.KEY)")
        out[k.strip()] = v
    return out


def _properties(path: str) -> dict[str, str]:
    """A Java properties file as spark-defaults.conf is written: `key value` or `key=value`."""
    out = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line or line[0] in "#!":
                    continue
                m = re.match(r"([^\s=:]+)\s*[\s=:]\s*(.*)$", line)
                if m:
                    out[m.group(1)] = m.group(2).strip()
                else:
                    out[line] = ""
    except OSError:
        pass
    return out


def _submit_args(env) -> tuple[str | None, dict[str, str], str | None, bool]:
    """(--master, --conf settings, --properties-file, --load-spark-defaults) of
    PYSPARK_SUBMIT_ARGS."""
    try:
        words = shlex.split(env.get("PYSPARK_SUBMIT_ARGS", ""))
    except ValueError:
        words = []
    master, conf, props, load_defaults = None, {}, None, False
    i = 0
    while i < len(words):
        w = words[i]
        name, eq, inline = w.partition("=") if w.startswith("--") else (w, "", "")
        value = inline if eq else (words[i + 1] if i + 1 < len(words) else None)
        step = 1 if eq else 2
        if name == "--master" and value is not None:
            master = value
        elif name in ("--conf", "-c") and value is not None:
            k, e2, v = value.partition("=")
            if e2:
                conf[k.strip()] = v
        elif name == "--properties-file" and value is not None:
            props = value
        elif name == "--load-spark-defaults":
            load_defaults, step = True, 1
        else:
            step = 1
        i += step
    return master, conf, props, load_defaults


def spark_conf_dir(env=None) -> str:
    env = os.environ if env is None else env
    if env.get("SPARK_CONF_DIR"):
        return env["SPARK_CONF_DIR"]
    home = env.get("SPARK_HOME")
    if not home:
        try:  # a pip-installed pyspark is its own SPARK_HOME (bin/, jars/, conf/ if any)
            import pyspark

            home = os.path.dirname(os.path.abspath(pyspark.__file__))
        except ImportError:  # no pyspark: there is no Spark configuration either
            return ""
    return os.path.join(home, "conf")


def resolve_master(master: str | None = None, conf: dict[str, str] | None = None, env=None) -> tuple[str, str]:
    """(master, where it came from), in spark-submit's precedence, local[2] last."""
    env = os.environ if env is None else env
    if master:
        return master, "--master"
    if (conf or {}).get("spark.master"):
        return conf["spark.master"], "--conf spark.master"
    sub_master, sub_conf, props_file, load_defaults = _submit_args(env)
    if sub_master:
        return sub_master, "PYSPARK_SUBMIT_ARGS (--master)"
    if sub_conf.get("spark.master"):
        return sub_conf["spark.master"], "PYSPARK_SUBMIT_ARGS (--conf spark.master)"
    files = []
    if props_file:
        files.append(props_file)
    if not props_file or load_defaults:
        d = spark_conf_dir(env)
        if d:
            files.append(os.path.join(d, "spark-defaults.conf"))
    for path in files:
        value = _properties(path).get("spark.master")
        if value:
            return value, path
    if env.get("MASTER"):
        return env["MASTER"], "$MASTER"
    return DEFAULT_MASTER, "the default"


def is_local(master: str) -> bool:
    """local, local[N], local[N,F], local-cluster[...]: executors on this machine."""
    return master.startswith("local")


def session_settings(master: str | None = None, app: str = "ledgerkv", conf: dict[str, str] | None = None, *, quiet: bool = True, env=None) -> tuple[dict[str, str], str, str]:
    """(the settings to start Spark with, the master, where the master came from).

    spark.master is set only when kv chose it (--master, or the default): Spark's own
    configuration otherwise applies as Spark applies it. --conf settings win over kv's
    defaults. Quiet: Spark's log4j output is off (this package's log4j2-quiet.properties),
    unless the settings already name a log4j configuration."""
    conf = dict(conf or {})
    chosen, source = resolve_master(master, conf, env)
    settings = {
        "spark.app.name": app,
        "spark.ui.showConsoleProgress": str(sys.stderr.isatty()).lower(),  # a progress bar on a terminal
        # No web UI: a command needs none, and Spark's listens on every interface (port 4040
        # up) for as long as the command runs; it also costs the start a few tenths of a second.
        "spark.ui.enabled": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
    }
    settings.update(conf)
    if source in ("--master", "the default"):
        settings["spark.master"] = chosen
    if quiet:
        opts = settings.get("spark.driver.extraJavaOptions", "")
        if "log4j2.configurationFile" not in opts and "log4j.configurationFile" not in opts:
            settings["spark.driver.extraJavaOptions"] = (opts + " " if opts else "") + f"-Dlog4j2.configurationFile=file:{QUIET_LOG4J}"
    return settings, chosen, source


def worker_python(master: str, settings: dict[str, str]) -> str | None:
    """The executors' Python to set (as PYSPARK_PYTHON, unless set already): with a local
    master this same one (or a --conf spark.pyspark.python); on a cluster None — the
    driver's path need not exist on a worker, and Spark's own setting applies."""
    if not is_local(master):
        return None
    return settings.get("spark.pyspark.python") or sys.executable


def session(master: str | None = None, app: str = "ledgerkv", conf: dict[str, str] | None = None, *, quiet: bool = True, ship_package: bool = False, warm_up: bool = True):
    """A SparkSession for ledgerkv's pipeline.

    `master`: None follows Spark's configuration, local[2] if it has none (see the module's
    docstring). `conf`: Spark settings (spark-submit's --conf). With a local master the
    workers run this same Python (PYSPARK_PYTHON, unless set); on a cluster Spark's own
    setting (PYSPARK_PYTHON, spark.pyspark.python) is left alone. `quiet`: no JVM log on
    stderr. `ship_package`: add this ledgerkv to the executors' Python path (a zip built
    from the installed layout, package_zip). `warm_up`: with a local master, start the
    Python worker for the first task in the background now (kv/spark/warmup.py), a
    one-row job: a first task that comes a few seconds later starts 2-3 s sooner."""
    from pyspark.sql import SparkSession

    settings, chosen, source = session_settings(master, app, conf, quiet=quiet)
    refuse_unreachable_master(chosen, source)
    python = worker_python(chosen, settings)
    if python:
        os.environ.setdefault("PYSPARK_PYTHON", python)
    if is_local(chosen):
        # Spark's driver (and, in local mode, its executors) listen on the address the host
        # name resolves to, or the first interface's when that is a loopback one: with a
        # local master nothing needs to reach them from elsewhere.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if quiet:
        _launch_quiet_gateway(settings)
        _silence_query_context_loggers()
    builder = SparkSession.builder
    for k, v in settings.items():
        builder = builder.config(k, v)
    s = builder.getOrCreate()
    if quiet and "log4j2-quiet" in settings.get("spark.driver.extraJavaOptions", ""):
        s.sparkContext.setLogLevel("OFF")  # also when the JVM was already running
    if ship_package:
        import atexit
        import shutil
        import tempfile

        where = tempfile.mkdtemp(prefix="kv-ship-")
        atexit.register(shutil.rmtree, where, True)  # Spark serves the file from there until then
        s.sparkContext.addPyFile(package_zip(where))
    if warm_up and is_local(chosen):
        from .warmup import start

        start(s)
    return s


def refuse_unreachable_master(master: str, source: str, timeout: float = 3.0) -> None:
    """SparkDidNotStart, at once, if no host of a standalone master URL (spark://h:p[,h2:p2])
    takes a connection: Spark itself would try for a minute, then say only that the context
    was stopped."""
    import socket

    if not master.startswith("spark://"):
        return
    why = []
    for hostport in master[len("spark://") :].split(","):
        hostport = hostport.strip()
        host, _, port = hostport.rpartition(":") if ":" in hostport.rpartition("]")[2] else (hostport, "", "7077")  # ([v6]:port)
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                return
        except (OSError, ValueError) as e:
            why.append(f"{host}:{port}: {e.strerror or e}" if isinstance(e, OSError) else f"{hostport}: {e}")
    raise SparkDidNotStart(f"Spark did not start: the master {master} (from {source}) does not answer ({'; '.join(why)}) — is it running? Check --master")


class SparkDidNotStart(KVError):
    """The driver JVM exited before it answered (a bad master URL, a bad spark-submit
    argument, no Java), or the standalone master it would join does not answer: the
    message is its root cause."""


def _silence_query_context_loggers() -> None:
    """PySpark logs an analysis error (a column --key-expr names that the data lacks) on
    stderr as a line of JSON with the JVM's whole stack (8 KB) before raising it, through
    Python loggers of its own (not log4j's): the command says what is wrong in one line."""
    from pyspark.logger import PySparkLogger

    for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
        PySparkLogger.getLogger(name).disabled = True


def _launch_quiet_gateway(settings: dict[str, str]) -> None:
    """Start the driver JVM (unless it runs already) with its stderr read through a pipe:
    what it prints while it starts is held back — dropped if it starts (the JVM's own
    notices, JVM_NOISE, always), its root cause raised as SparkDidNotStart if it does not —
    and what it prints later is passed on."""
    from pyspark import SparkConf, SparkContext
    from pyspark.errors import PySparkRuntimeError
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ:
        return
    conf = SparkConf(loadDefaults=False)
    for k, v in settings.items():
        conf.set(k, v)
    rfd, wfd = os.pipe()
    err = _JvmStderr()
    reader = threading.Thread(target=err.read, args=(rfd,), name="kv-spark-jvm-stderr", daemon=True)
    reader.start()
    try:
        gateway = launch_gateway(conf, popen_kwargs={"stderr": wfd})
    except PySparkRuntimeError as e:
        os.close(wfd)
        reader.join(5)  # the JVM exited: its output is all in the pipe
        text = "".join(err.held)
        cause = (_java_cause(text) or _last_line(text) or str(e)) if text.strip() else str(e)
        raise SparkDidNotStart(f"Spark did not start: {cause}" + (f" — {_hint(cause)}" if _hint(cause) else " (--debug shows Spark's output)")) from e
    os.close(wfd)  # the JVM holds its own copy; EOF when it exits
    err.started()
    SparkContext._ensure_initialized(gateway=gateway)


def _last_line(text: str) -> str | None:
    lines = [x.strip() for x in text.splitlines() if x.strip() and not x.startswith(JVM_NOISE)]
    return lines[-1] if lines else None


class _JvmStderr:
    def __init__(self) -> None:
        self.held: list[str] | None = []  # None once the JVM has started
        self.lock = threading.Lock()

    def started(self) -> None:
        with self.lock:
            self.held = None

    def read(self, fd: int) -> None:
        with os.fdopen(fd, "r", errors="replace") as f:
            for line in f:
                with self.lock:
                    if self.held is not None:
                        self.held.append(line)
                        continue
                if line.startswith(JVM_NOISE):
                    continue
                try:
                    sys.stderr.write(line)
                    sys.stderr.flush()
                except Exception:  # never stop reading: a full pipe would block the JVM
                    pass


# -- errors -----------------------------------------------------------------------------------

_JAVA_CAUSE = re.compile(r"^(?:Caused by: )?((?:[a-z_$][\w$]*\.)+[A-Z][\w$]*(?:Exception|Error|Throwable)[\w$]*)(?::\s*(.*))?$")


def _python_exception(text: str) -> str | None:
    """The exception line that ends the last Python traceback in `text`."""
    lines = text.splitlines()
    found = None
    for i, line in enumerate(lines):
        if line.rstrip().endswith("Traceback (most recent call last):"):
            for later in lines[i + 1 :]:
                if later.startswith((" ", "\t")) or not later.strip():
                    continue
                found = later.strip()  # the exception the traceback ends with
                break
    return found


def _java_cause(text: str) -> str | None:
    """The innermost Java exception named in `text` (the last `Caused by:`, else the first)."""
    first, last = None, None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("Caused by: "):
            m = _JAVA_CAUSE.match(s)
            if m:
                last = m
        elif first is None and not s.startswith("at "):
            m = _JAVA_CAUSE.match(re.sub(r'^Exception in thread "[^"]*" ', "", s).lstrip(": "))
            if m:
                first = m
    m = last or first
    if m is None:
        return None
    name, message = m.group(1).rsplit(".", 1)[-1], (m.group(2) or "").strip()
    return f"{name}: {message}" if message else name


def _hint(cause: str) -> str:
    m = re.search(r"No module named '([\w.]+)'", cause)
    if m:
        if m.group(1).split(".")[0] == "kv":
            return "the executors' Python cannot import ledgerkv: install it on every worker (pip install 'ledgerkv[spark]'), or ship it with --ship-package"
        return "the executors' Python lacks a module ledgerkv's tasks need: install ledgerkv[spark] (pyarrow, pandas) on every worker"
    if "pyFiles" in cause or re.search(r"(FileNotFound|NoSuchFile)\w*: .*\.(zip|egg|py)\b", cause):
        return "check the paths given to --py-files (spark.submit.pyFiles, PYSPARK_SUBMIT_ARGS)"
    if re.search(r"[Mm]aster (URL|must)", cause):
        return "check --master (or spark.master in --conf, PYSPARK_SUBMIT_ARGS, spark-defaults.conf, $MASTER)"
    return ""


def root_cause(e: BaseException, *, debug_hint: bool = True) -> str:
    """One line for a Spark failure: the innermost Python exception of a failed task, or
    the innermost Java cause, with what to do when it is a known one."""
    try:
        text = str(e)
    except Exception:  # a JVM already gone cannot render its exception
        text = repr(e)
    for attr in ("desc", "stackTrace"):  # pyspark's captured exceptions: the JVM's description
        extra = getattr(e, attr, None)
        if isinstance(extra, str) and extra not in text:
            text += "\n" + extra
    cause = _python_exception(text) or _java_cause(text)
    if cause is None:
        lines = [x.strip() for x in text.splitlines() if x.strip()]
        cause = lines[0] if lines else type(e).__name__
    cause = cause[:500]
    hint = _hint(cause)
    if hint:
        cause += f" — {hint}"
    elif debug_hint:
        cause += " (--debug shows Spark's log)"
    return cause


# -- shipping the package ---------------------------------------------------------------------


def package_zip(directory: str) -> str:
    """A zip of this ledgerkv as it imports — kv/ with its mapped sub-packages under it
    (from a checkout: raft/, http/, ... beside kv/) — for sc.addPyFile; returns its path."""
    import importlib
    import zipfile

    import kv

    own = os.path.dirname(os.path.abspath(kv.__file__))
    trees = [(own, "kv")]
    for name in MAPPED_PACKAGES:
        mod = importlib.import_module(f"kv.{name}")
        for d in list(mod.__path__):
            d = os.path.abspath(d)
            if os.path.commonpath([d, own]) != own:  # not copied under kv/ already
                trees.append((d, f"kv/{name}"))
    path = os.path.join(directory, "ledgerkv.zip")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for top, arc in trees:
            for folder, dirs, files in os.walk(top):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
                rel = os.path.relpath(folder, top)
                prefix = arc if rel == "." else f"{arc}/{rel.replace(os.sep, '/')}"
                if folder != top or top != own:
                    # a mapped folder has no __init__.py in a checkout (a top-level `http`
                    # must not shadow the standard library's); under kv/ in the zip it may
                    if "__init__.py" not in files and any(f.endswith(".py") for f in files):
                        z.writestr(f"{prefix}/__init__.py", "")
                for f in sorted(files):
                    if f.endswith(PACKAGE_DATA):
                        z.write(os.path.join(folder, f), f"{prefix}/{f}")
    return path
