# NixOS VM test: a leader (lux, control plane, runs etcd and fabric-leader) and
# an edge host (racknerd, Caddy and the socat port maps) reconcile the example
# fleet of hosts/ through an etcd registry. A pass renders and activates; the
# timer is active, the last pass succeeded and the journal holds the audit
# entries (`journalctl -t fabric-reconcile`).
{ self }:
{ hostPkgs, ... }:

let
  # The example fleet with the registry pointed at the leader's etcd.
  fleet = hostPkgs.runCommand "fabric-test-fleet" { } ''
    cp -r ${../hosts} $out
    chmod -R u+w $out
    substituteInPlace $out/fabric.toml \
      --replace-fail 'backend = "sqlite"' 'backend = "etcd"
    endpoints = ["http://lux:2379"]'
  '';

  common = {
    imports = [ self.nixosModules.default ];
    services.fabric = {
      enable = true;
      desired.path = "${fleet}";
      # Faster than the default so the test sees several passes.
      interval = "10s";
      randomizedDelaySec = "1s";
    };
    networking.nftables.enable = true;
    networking.firewall.allowedTCPPorts = [ 2379 ];
  };
in
{
  name = "fabric";

  nodes = {
    lux =
      { ... }:
      {
        imports = [ common ];
        services.fabric.leaderCandidate = true;
        services.etcd = {
          enable = true;
          listenClientUrls = [ "http://0.0.0.0:2379" ];
          advertiseClientUrls = [ "http://lux:2379" ];
        };
      };

    racknerd =
      { ... }:
      {
        imports = [ common ];
        services.caddy = {
          enable = true;
          globalConfig = "auto_https off";
        };
      };
  };

  testScript = ''
    start_all()
    lux.wait_for_unit("etcd.service")
    lux.wait_for_unit("fabric-leader.service")

    for machine in (lux, racknerd):
        machine.wait_for_unit("fabric-reconcile.timer")
        machine.succeed("systemctl status fabric-reconcile.timer")
        # A pass on demand, then the outcome systemd recorded for it.
        machine.succeed("systemctl start fabric-reconcile.service")
        machine.succeed("systemctl show -p Result --value fabric-reconcile.service | grep -qx success")
        machine.succeed("systemctl show -p ExecMainStatus --value fabric-reconcile.service | grep -qx 0")
        machine.succeed("systemctl status fabric-reconcile.service | grep -q 'status=0/SUCCESS'")
        # The audit entries of the pass.
        machine.succeed("journalctl -t fabric-reconcile --no-pager | grep -q .")
        # A switch-like reload of NixOS's ruleset keeps the fabric's table.
        machine.succeed("nft list table inet fabric")
        machine.succeed("systemctl reload nftables.service")
        machine.succeed("nft list table inet fabric")

    # The edge: its port maps run as socat units and Caddy imports the snippet.
    racknerd.wait_for_unit("fabric-socat-qfox-ssh.service")
    racknerd.wait_for_unit("fabric-socat-lux-smb.service")
    racknerd.succeed("test -f /etc/caddy/fabric.caddy")
  '';
}
