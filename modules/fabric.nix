# services.fabric: the fabric reconciler on a NixOS host.
#
# Every host runs fabric-reconcile.timer: one pass every `interval` (load the
# desired state, probe, heartbeat, render, activate, audit to the journal),
# and fabric-watch.service, which starts that pass as soon as the registry
# changes for this host (a new plan, its drain, its node state); the timer
# stays the backstop. Leader candidates also run fabric-leader.service.
#
# The unit values here mirror reconciler/core/install/units.py, which scripts/join.sh
# installs on hosts without NixOS; tests/unit/test_nix_module.py evaluates this
# file and fails if command, timer or hardening differ.
#
# Living beside NixOS's own services:
# - Units the fabric renders go to /run/systemd/system (`unitDir`): NixOS keeps
#   /etc/systemd/system read-only in the Nix store, /run/systemd/system is in
#   systemd's search path below /etc (a unit NixOS declares always wins over
#   one of the same name), and switch-to-configuration never stops units it did
#   not declare. /run is empty after boot; the first pass (OnBootSec) renders
#   them again.
# - Caddy: services.caddy imports the fabric's site snippet
#   (`import /etc/caddy/fabric*.caddy`, a glob so Caddy starts before the
#   first pass wrote it); the NixOS-built Caddyfile stays the one config and a
#   reload of caddy.service picks the snippet up.
# - nftables: the fabric owns only `table inet fabric`. NixOS's nftables
#   service flushes the whole ruleset on reload when given a raw ruleset
#   (`flushRuleset`); this module defaults that to false so a
#   `nixos-rebuild switch` keeps the fabric's table. A `flush ruleset` line in
#   your own networking.nftables.ruleset would still remove it until the next
#   pass (at most `interval` later).
{
  config,
  lib,
  pkgs,
  ...
}:

let
  cfg = config.services.fabric;
  settingsFormat = pkgs.formats.toml { };

  dropNulls = lib.filterAttrs (_: value: value != null);

  # node.toml: the options below, then `settings` on top (settings wins).
  nodeSettings = lib.recursiveUpdate (
    {
      node = dropNulls {
        host = cfg.hostName;
        desired = cfg.desired.path;
        unit_dir = cfg.unitDir;
        state_dir = "/var/lib/fabric";
        registry_path = cfg.registry.sqlitePath;
      };
      timer = {
        interval = cfg.interval;
        randomized_delay = cfg.randomizedDelaySec;
      };
    }
    // lib.optionalAttrs (cfg.desired.git.remote != null) {
      source = dropNulls {
        inherit (cfg.desired.git) remote branch;
        ssh_key_file = cfg.desired.git.sshKeyFile;
        ssh_host_key = cfg.desired.git.sshHostKey;
        require_signed_commits = cfg.desired.git.requireSignedCommits;
        allowed_signers_file = cfg.desired.git.allowedSignersFile;
      };
    }
  ) cfg.settings;

  nodeConfigPath = "/etc/fabric/node.toml";
  # HOME: `caddy validate` needs one for its own CA (reconciler/core/install/units.py PASS_HOME).
  passEnvironment = { HOME = "/var/lib/fabric"; } // registryEnvironment;
  registryEnvironment = lib.optionalAttrs (nodeSettings.node ? registry_path) {
    FABRIC_REGISTRY = nodeSettings.node.registry_path;
  };
  fabric = "${cfg.package}/bin/fabric";

  reconcileArgv =
    [
      fabric
      "reconcile"
      "--desired"
      nodeSettings.node.desired
      "--unit-dir"
      nodeSettings.node.unit_dir
    ]
    ++ lib.optionals (nodeSettings.node ? host) [
      "--host"
      nodeSettings.node.host
    ];
  pullArgv = [
    fabric
    "pull"
    "--config"
    nodeConfigPath
  ];
  leaderArgv =
    [
      fabric
      "leader"
      "run"
      "--desired"
      nodeSettings.node.desired
    ]
    ++ lib.optionals (nodeSettings.node ? host) [
      "--host"
      nodeSettings.node.host
    ];

  bootstrapArgv = [
    fabric
    "bootstrap"
    "--config"
    nodeConfigPath
    "--first-boot"
  ];

  watchArgv =
    [
      fabric
      "watch"
      "--desired"
      nodeSettings.node.desired
    ]
    ++ lib.optionals (nodeSettings.node ? host) [
      "--host"
      nodeSettings.node.host
    ];

  # Shared by the pass, the leader and the watcher; reasons in reconciler/core/install/units.py (HARDENING).
  # No PrivateDevices in the pass: the probe must see /dev/dri and /dev/nvidia*.
  hardening = {
    ProtectSystem = "strict";
    ReadWritePaths = [
      "-/etc/systemd/system"
      "-/run/systemd/system"
      "-/etc/fabric"
      "-/etc/caddy"
      "-/etc/rancher/k3s"
      "-/etc/phaze"
      "-/etc/sysusers.d"
      "-/var/lib/node_exporter/textfile"
    ];
    StateDirectory = "fabric";
    StateDirectoryMode = "0755";
    ProtectHome = true;
    PrivateTmp = true;
    NoNewPrivileges = true;
    ProtectKernelModules = true;
    ProtectKernelLogs = true;
    ProtectKernelTunables = true;
    ProtectControlGroups = true;
    ProtectClock = true;
    ProtectHostname = true;
    RestrictNamespaces = true;
    RestrictRealtime = true;
    RestrictSUIDSGID = true;
    LockPersonality = true;
    SystemCallArchitectures = "native";
    RestrictAddressFamilies = "AF_UNIX AF_INET AF_INET6 AF_NETLINK";
    UMask = "0022";
  };

  # The trust anchors stay read-only inside every fabric unit (units.py TRUST_ANCHORS).
  trustAnchors = [
    "-/etc/fabric/node.toml"
    "-/etc/fabric/allowed_signers"
    "-/etc/fabric/plan-signing.key"
    "-/etc/fabric/deploy-key"
    "-/etc/fabric/etcd"
  ];

  # The pass: what activation needs and no more (units.py PASS_HARDENING).
  passHardening = hardening // {
    ReadOnlyPaths = trustAnchors;
    CapabilityBoundingSet = "CAP_NET_ADMIN CAP_NET_BIND_SERVICE CAP_DAC_OVERRIDE CAP_DAC_READ_SEARCH CAP_FOWNER CAP_CHOWN";
    KeyringMode = "private";
    ProtectProc = "invisible";
    SystemCallFilter = [ "@system-service" ];
    SystemCallErrorNumber = "EPERM";
  };

  # The watcher and the leader: no capability, nothing writable but their
  # state directory (units.py DAEMON_HARDENING).
  daemonHardening = (builtins.removeAttrs hardening [ "ReadWritePaths" ]) // {
    CapabilityBoundingSet = "";
    AmbientCapabilities = "";
    PrivateDevices = true;
    DevicePolicy = "closed";
    ProtectProc = "invisible";
    ProcSubset = "pid";
    PrivateIPC = true;
    RemoveIPC = true;
    KeyringMode = "private";
    RestrictAddressFamilies = "AF_UNIX AF_INET AF_INET6";
    SystemCallFilter = [
      "@system-service"
      "~@privileged @resources"
    ];
    SystemCallErrorNumber = "EPERM";
  };

  # The programs a pass calls.
  runtimePath =
    [
      pkgs.nftables
      pkgs.caddy
      pkgs.git
      pkgs.openssh
      pkgs.socat
      pkgs.iproute2
      pkgs.pciutils
      pkgs.util-linux
      config.systemd.package
    ]
    ++ lib.optional config.services.tailscale.enable config.services.tailscale.package
    # The pass renders the fabric's Ray units with the `ray` it finds on its PATH.
    ++ lib.optional (cfg.ray.package != null) cfg.ray.package
    ++ cfg.extraPackages;
in
{
  options.services.fabric = {
    enable = lib.mkEnableOption "the fabric reconciler (fabric-reconcile.timer on this host)";

    package = lib.mkOption {
      type = lib.types.package;
      defaultText = lib.literalExpression "fabric.packages.\${pkgs.stdenv.hostPlatform.system}.default";
      description = "The fabric package (the flake's nixosModules.default sets it).";
    };

    hostName = lib.mkOption {
      type = lib.types.nullOr lib.types.str;
      default = config.networking.hostName;
      defaultText = lib.literalExpression "config.networking.hostName";
      example = "racknerd";
      description = "Which host of the desired state this machine is (`fabric reconcile --host`).";
    };

    desired = {
      path = lib.mkOption {
        type = lib.types.str;
        default = "/var/lib/fabric/desired";
        description = ''
          The desired-state directory (fabric.toml and the host files). With
          `desired.git.remote` set, the checkout the pass pulls into.
        '';
      };
      git = {
        remote = lib.mkOption {
          type = lib.types.nullOr lib.types.str;
          default = null;
          example = "git@github.com:researchstack/fleet.git";
          description = "Git remote of the desired state, fetched before each pass (`fabric pull`). Null: `desired.path` is used as it is.";
        };
        branch = lib.mkOption {
          type = lib.types.str;
          default = "main";
          description = "Branch of the desired state to follow.";
        };
        sshKeyFile = lib.mkOption {
          type = lib.types.nullOr lib.types.str;
          default = null;
          example = "/run/secrets/fleet-deploy-key";
          description = "SSH deploy key for the remote, as a path (never copied into the store).";
        };
        requireSignedCommits = lib.mkOption {
          type = lib.types.bool;
          default = true;
          description = ''
            Accept a fetched commit only if its SSH signature verifies against `allowedSignersFile`; otherwise keep the
            last good checkout. On by default: whoever can push to the remote runs anything as root on this host, so
            turning it off is an explicit choice (`fabric status` says so while it is off).
          '';
        };
        sshHostKey = lib.mkOption {
          type = lib.types.nullOr lib.types.str;
          default = null;
          example = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl";
          description = "The ssh remote's host key as `ssh-keyscan HOST` prints it after the host name; required for an ssh remote (pinned: no key is accepted on first use).";
        };
        allowedSignersFile = lib.mkOption {
          type = lib.types.nullOr lib.types.str;
          default = null;
          example = "/etc/fabric/allowed_signers";
          description = "ssh-keygen allowed signers file (gpg.ssh.allowedSignersFile) for `requireSignedCommits`.";
        };
      };
    };

    interval = lib.mkOption {
      type = lib.types.str;
      default = "30s";
      description = "Time between two passes (systemd time span, OnUnitActiveSec).";
    };

    randomizedDelaySec = lib.mkOption {
      type = lib.types.str;
      default = "5s";
      description = "Random delay added to each pass, so a fleet does not pass in lockstep.";
    };

    unitDir = lib.mkOption {
      type = lib.types.str;
      default = "/run/systemd/system";
      description = "Where the pass writes the units it renders (`fabric reconcile --unit-dir`); must be in systemd's unit search path and writable.";
    };

    leaderCandidate = lib.mkOption {
      type = lib.types.bool;
      default = false;
      description = "Run fabric-leader.service (the host must be in the fleet's leader_candidates).";
    };

    hookPackages = lib.mkOption {
      type = lib.types.listOf lib.types.package;
      default = [ ];
      description = ''
        Programs the fleet's cloud hooks name by PATH name (the example's
        batch hook: sh and gh, e.g. [ pkgs.bash pkgs.gh ]), put on
        fabric-leader's PATH: systemd-run looks a hook's program up there
        before it starts the hook's sandboxed unit.
      '';
    };

    registry.sqlitePath = lib.mkOption {
      type = lib.types.nullOr lib.types.str;
      default = null;
      example = "/var/lib/fabric/registry.sqlite";
      description = ''
        Use this sqlite registry file whatever the fleet's fabric.toml
        [registry] says (FABRIC_REGISTRY for the fabric's services): a
        single-host fleet or a demo. Null: the registry the desired state
        names; a fleet's etcd endpoints and client certificate paths live
        there, the same for every host. The paths are fleet-wide, the files
        are not: each host keeps its own client certificate (CN = its host
        name, signed by the fleet's CA) and key (root-only) at [registry]
        cert_file/key_file, deployed like any secret (agenix, sops-nix),
        never from the Nix store. With etcd's auth on (`fabric registry
        init-auth`, with root's certificate) a host writes only its own
        heartbeat and only leader candidates write the plan. The embedded
        sqlite file is created 0600 and refused when others can write it.
      '';
    };

    caddy.importSnippets = lib.mkOption {
      type = lib.types.bool;
      default = config.services.caddy.enable;
      defaultText = lib.literalExpression "config.services.caddy.enable";
      description = "Make services.caddy import the fabric's site snippet (/etc/caddy/fabric.caddy).";
    };

    nftables.keepFabricTable = lib.mkOption {
      type = lib.types.bool;
      default = true;
      description = "Default networking.nftables.flushRuleset to false, so reloading NixOS's ruleset keeps `table inet fabric`.";
    };

    nodeExporterTextfile = lib.mkOption {
      type = lib.types.bool;
      default = true;
      description = ''
        Point the textfile collector of services.prometheus.exporters.node
        (when enabled) at /var/lib/node_exporter/textfile, where each pass
        writes fabric.prom. NixOS's exporter has no textfile directory of its
        own; turn this off if extraFlags already name one (node_exporter
        refuses the flag twice) and link fabric.prom there.
      '';
    };

    trustTailnet = lib.mkOption {
      type = lib.types.bool;
      default = false;
      description = ''
        Trust the Tailscale interface in NixOS's firewall. An accept in the
        fabric's own table cannot override a drop in NixOS's input chain, so
        fabric ports on the tailnet need this (or networking.firewall ports).
      '';
    };

    ray.package = lib.mkOption {
      type = lib.types.nullOr lib.types.package;
      default = null;
      example = lib.literalExpression "pkgs.python3Packages.ray";
      description = ''
        The Ray whose `ray` program the fabric's Ray units run on this host
        (fabric-ray-head.service, fabric-ray-worker.service, when fabric.toml's
        [ray] names the host): put on the pass's PATH, so the rendered units
        name its store path. Every node of one cluster needs the same Ray
        version (the fabric tests 2.60.0). Null: [ray] command, else
        /usr/bin/ray.
      '';
    };

    bootstrap.enable = lib.mkOption {
      type = lib.types.bool;
      default = true;
      description = ''
        Run fabric-bootstrap.service at the first boot, once: the seed's
        bootstrap agent (`fabric bootstrap --first-boot`: tailscale up with
        settings.bootstrap.tailscale_auth_key_file, probe, labels, register
        as a host or report pending, the k3s agent's join where k3s-agent.service
        exists and a token file is given, the nftables fix, the first pass
        queued). Its last step writes /var/lib/fabric/bootstrap.stamp; the unit
        is skipped while that file exists, and a failed step leaves none, so
        the next boot tries again. Remove the stamp to run it again.
      '';
    };

    extraPackages = lib.mkOption {
      type = lib.types.listOf lib.types.package;
      default = [ ];
      description = "More programs on the pass's PATH.";
    };

    settings = lib.mkOption {
      type = lib.types.submodule { freeformType = settingsFormat.type; };
      default = { };
      example = {
        bootstrap.k3s_server = "https://100.101.7.10:6443";
        bootstrap.k3s_token_file = "/run/secrets/k3s-token";
      };
      description = ''
        Extra node.toml settings (see reconciler/core/install/nodeconfig.py), merged over
        the ones the options above produce. Rendered to /etc/fabric/node.toml.
      '';
    };
  };

  config = lib.mkIf cfg.enable (
    lib.mkMerge [
      {
        assertions = [
          {
            assertion = !cfg.leaderCandidate || nodeSettings.node ? host;
            message = "services.fabric.leaderCandidate needs services.fabric.hostName (the candidate campaigns under it).";
          }
          {
            assertion = cfg.desired.git.remote == null || lib.hasPrefix "/var/lib/fabric/" nodeSettings.node.desired;
            message = "services.fabric.desired.path must be under /var/lib/fabric with a git remote (the only directory a pass may write).";
          }
          {
            assertion = cfg.desired.git.remote == null || !cfg.desired.git.requireSignedCommits || cfg.desired.git.allowedSignersFile != null;
            message = "services.fabric.desired.git needs allowedSignersFile: commits must be signed unless requireSignedCommits = false says otherwise.";
          }
        ];

        environment.etc."fabric/node.toml".source = settingsFormat.generate "fabric-node.toml" nodeSettings;
        # `fabric status`, `fabric plan` and friends for the operator; socat and
        # nft at a stable path for the units the fabric renders.
        environment.systemPackages = [
          cfg.package
          pkgs.socat
          pkgs.nftables
        ];

        systemd.services.fabric-reconcile = {
          description = "fabric: one reconcile pass of this host";
          wants = [ "network-online.target" ];
          after = [
            "network-online.target"
            "nftables.service"
            "caddy.service"
          ];
          # A switch must not run or cut a pass: the timer does.
          restartIfChanged = false;
          stopIfChanged = false;
          unitConfig = {
            X-StopOnRemoval = false;
            # No start rate limit: the watcher starts a pass per new plan, and
            # systemd's default (5 in 10 s) would refuse one while StartUnit
            # still succeeds (reconciler/core/install/units.py PASS_START_LIMIT_INTERVAL).
            StartLimitIntervalSec = 0;
          };
          path = runtimePath;
          environment = passEnvironment;
          serviceConfig =
            passHardening
            // {
              Type = "oneshot";
              SyslogIdentifier = "fabric-reconcile";
              TimeoutStartSec = "10min";
              ExecStart = lib.concatStringsSep " " reconcileArgv;
            }
            // lib.optionalAttrs (nodeSettings ? source) {
              ExecStartPre = lib.concatStringsSep " " pullArgv;
            };
        };

        # Starts fabric-reconcile.service over D-Bus when the registry changes
        # for this host (reconciler/core/install/units.py watch_service).
        systemd.services.fabric-watch = {
          description = "fabric: start a reconcile pass as soon as the registry changes for this host";
          wantedBy = [ "multi-user.target" ];
          wants = [ "network-online.target" ];
          after = [ "network-online.target" ];
          path = runtimePath;
          environment = passEnvironment;
          serviceConfig = daemonHardening // {
            Type = "simple";
            SyslogIdentifier = "fabric-watch";
            Restart = "on-failure";
            RestartSec = "5s";
            ExecStart = lib.concatStringsSep " " watchArgv;
          };
        };

        systemd.timers.fabric-reconcile = {
          description = "fabric: reconcile this host every interval";
          wantedBy = [ "timers.target" ];
          timerConfig = {
            OnBootSec = "15s";
            OnUnitActiveSec = nodeSettings.timer.interval;
            RandomizedDelaySec = nodeSettings.timer.randomized_delay;
            # The default (1 min) would stretch a 30 s interval to a minute.
            AccuracySec = "1s";
            Persistent = true;
          };
        };

        networking.nftables.flushRuleset = lib.mkIf cfg.nftables.keepFabricTable (lib.mkDefault false);

        services.caddy.extraConfig = lib.mkIf cfg.caddy.importSnippets ''
          import /etc/caddy/fabric*.caddy
        '';
        # The pass writes there (ProtectSystem=strict leaves only existing
        # directories writable).
        systemd.tmpfiles.rules = [
          "d /etc/fabric 0755 root root -"
          "d /etc/rancher/k3s/config.yaml.d 0755 root root -"
          "d /etc/phaze 0755 root root -"
          "d /etc/sysusers.d 0755 root root -"
          "d /var/lib/node_exporter/textfile 0755 root root -"
        ] ++ lib.optional cfg.caddy.importSnippets "d /etc/caddy 0755 root root -";

        services.prometheus.exporters.node.extraFlags = lib.mkIf (cfg.nodeExporterTextfile && config.services.prometheus.exporters.node.enable) [
          "--collector.textfile.directory=/var/lib/node_exporter/textfile"
        ];

        networking.firewall.trustedInterfaces = lib.mkIf cfg.trustTailnet [
          config.services.tailscale.interfaceName
        ];
      }

      # The bootstrap agent, once at first boot (reconciler/core/install/units.py bootstrap_service).
      (lib.mkIf cfg.bootstrap.enable {
        systemd.services.fabric-bootstrap = {
          description = "fabric: bootstrap this machine at its first boot (once), then exit";
          wantedBy = [ "multi-user.target" ];
          wants = [ "network-online.target" ];
          after = [ "network-online.target" ] ++ lib.optional config.services.tailscale.enable "tailscaled.service";
          # The timer's first pass at boot waits for it (the bootstrap only
          # queues that pass: it never waits for a unit ordered after it).
          before = [ "fabric-reconcile.service" ];
          # A switch must not run it again (its stamp would skip it anyway).
          restartIfChanged = false;
          unitConfig.ConditionPathExists = "!/var/lib/fabric/bootstrap.stamp";
          path = runtimePath;
          environment = passEnvironment;
          serviceConfig =
            {
              Type = "oneshot";
              SyslogIdentifier = "fabric-bootstrap";
              TimeoutStartSec = "15min";
              ExecStart = lib.concatStringsSep " " bootstrapArgv;
              PrivateTmp = true;
              UMask = "0022";
            }
            // lib.optionalAttrs (nodeSettings ? source) {
              ExecStartPre = lib.concatStringsSep " " pullArgv;
            };
        };
      })

      (lib.mkIf cfg.leaderCandidate {
        systemd.services.fabric-leader = {
          description = "fabric: campaign for leadership and publish the plan";
          wantedBy = [ "multi-user.target" ];
          wants = [ "network-online.target" ];
          after = [ "network-online.target" ];
          path = runtimePath ++ cfg.hookPackages;
          environment = passEnvironment;
          serviceConfig = daemonHardening // {
            Type = "simple";
            SyslogIdentifier = "fabric-leader";
            Restart = "always";
            RestartSec = "5s";
            ExecStart = lib.concatStringsSep " " leaderArgv;
          };
        };
      })
    ]
  );
}
