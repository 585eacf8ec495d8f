{
  description = "fabric: a self-adapting compute fabric reconciled by systemd timers";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-24.11";

  outputs =
    { self, nixpkgs }:
    let
      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];
      forAllSystems = f: nixpkgs.lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
    in
    {
      packages = forAllSystems (pkgs: rec {
        fabric = pkgs.callPackage ./nix/package.nix { };
        default = fabric;
      });

      overlays.default = final: _prev: { fabric = final.callPackage ./nix/package.nix { }; };

      # services.fabric, with the package of this flake as its default.
      nixosModules.default =
        { lib, pkgs, ... }:
        {
          imports = [ ./modules/fabric.nix ];
          services.fabric.package = lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.default;
        };

      checks = forAllSystems (pkgs: {
        package = self.packages.${pkgs.stdenv.hostPlatform.system}.default;
        # Two machines, a leader and an edge host, reconciling the example fleet.
        vm = pkgs.testers.runNixOSTest (import ./nix/vm-test.nix { inherit self; });
      });

      devShells = forAllSystems (pkgs: {
        default = pkgs.mkShell {
          packages = [
            (pkgs.python3.withPackages (
              ps: with ps; [
                pydantic
                jinja2
                dbus-fast
                aetcd
                psycopg
                psycopg.pool
                pytest
                pytest-subprocess
                hypothesis
                pyroute2
                # the build backend: tests/integration build the wheel offline
                setuptools
                wheel
              ]
            ))
            pkgs.nftables
            pkgs.caddy
            pkgs.socat
            pkgs.etcd
            pkgs.postgresql_15
            pkgs.git
            pkgs.iproute2
            pkgs.nixfmt-rfc-style
          ];
        };
      });

      formatter = forAllSystems (pkgs: pkgs.nixfmt-rfc-style);
    };
}
