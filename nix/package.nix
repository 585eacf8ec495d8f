# The fabric reconciler, built from nixpkgs' Python packages.
{
  lib,
  python3Packages,
}:

python3Packages.buildPythonApplication {
  pname = "fabric-reconciler";
  version = "0.1.0";
  pyproject = true;

  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [
      ../pyproject.toml
      ../README.md
      ../reconciler
      ../templates
    ];
  };

  build-system = [ python3Packages.setuptools ];

  dependencies = with python3Packages; [
    pydantic
    jinja2
    dbus-fast
    aetcd
  ];

  # reconciler/core/render/artifacts.py finds its templates beside the package
  # (<site-packages>/templates); setuptools installs only the package itself.
  postInstall = ''
    cp -r templates "$out/${python3Packages.python.sitePackages}/templates"
  '';

  # The test suite needs real nft, caddy, etcd and systemd as PID 1; the VM
  # test in checks.<system>.vm runs the package for real instead.
  pythonImportsCheck = [
    "reconciler"
    "reconciler.cli"
  ];

  meta = {
    description = "fabric: a self-adapting compute fabric reconciled by systemd timers";
    license = lib.licenses.mit;
    mainProgram = "fabric";
    platforms = lib.platforms.linux;
  };
}
