# The fabric reconciler, built from nixpkgs' Python packages: setuptools builds
# the wheel pyproject.toml describes (the templates are package data inside
# it) and it is installed like any other Python application.
{
  lib,
  python3Packages,
}:

let
  # The version is written in pyproject.toml only.
  pyproject = lib.importTOML ../pyproject.toml;
  # phaze's queue library (reconciler/adapters/lane_broker_pg.py), not in nixpkgs.
  saq = python3Packages.buildPythonPackage rec {
    pname = "saq";
    version = "0.26.4";
    format = "wheel";
    src = python3Packages.fetchPypi {
      inherit pname version format;
      dist = "py3";
      python = "py3";
      hash = "sha256-eh+BriqVtsNLFwvJuM+EQjBS2WEvYs8OxCbB/SfjWyw=";
    };
    dependencies = [ python3Packages.croniter ];
    pythonImportsCheck = [ "saq" ];
  };
in
python3Packages.buildPythonApplication {
  pname = "fabric-reconciler";
  inherit (pyproject.project) version;
  pyproject = true;

  # What the build reads; the top-level templates/ is only a link into
  # reconciler/.
  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [
      ../pyproject.toml
      ../README.md
      ../reconciler
    ];
  };

  build-system = [ python3Packages.setuptools ];

  # pyproject.toml's dependencies; the runtime-deps check compares the two.
  # python3Packages.aetcd is 1.0.0a4, inside pyproject.toml's pin. psycopg's
  # pool is its passthru `pool`. saq is not in nixpkgs: built below from
  # PyPI's wheel (the hash of saq-0.26.4-py3-none-any.whl as pip fetched it).
  dependencies =
    (with python3Packages; [
      pydantic
      jinja2
      dbus-fast
      aetcd
      grpcio
      cryptography
      psycopg
      psycopg.pool
      prometheus-client
    ])
    ++ [ saq ];

  # The test suite needs real nft, caddy, etcd and systemd as PID 1; the VM
  # test in checks.<system>.vm runs the package for real instead.
  pythonImportsCheck = [
    "reconciler"
    "reconciler.cli"
    "reconciler.core.templating"
  ];

  meta = {
    description = pyproject.project.description;
    license = lib.licenses.mit;
    mainProgram = "fabric";
    platforms = lib.platforms.linux;
  };
}
