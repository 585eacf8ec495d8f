# Evaluate modules/fabric.nix offline, without nixpkgs: a small stand-in for
# the parts of nixpkgs' lib and pkgs the module uses, and a small evaluator
# (option defaults, user values on top, mkIf/mkMerge/mkDefault resolved).
#
# Used by tests/unit/test_nix_module.py. It is deliberately strict: calling a
# lib function the stand-in does not define fails the evaluation, so a module
# change that needs more of lib shows up as a test failure to extend this file,
# never as a silently wrong value.
#
#   nix-instantiate --eval --strict --json --store dummy:// \
#     --arg module ./modules/fabric.nix --arg userConfig '{ ... }' eval-module.nix
{
  module,
  userConfig,
  hostName ? "nixos",
  caddyEnable ? false,
  tailscaleEnable ? false,
  nodeExporterEnable ? false,
}:

let
  isType = type: value: builtins.isAttrs value && (value._type or null) == type;

  recursiveUpdate =
    lhs: rhs:
    lhs
    // builtins.mapAttrs (
      name: value:
      if builtins.isAttrs value && builtins.isAttrs (lhs.${name} or null) && !(value ? _type) then
        recursiveUpdate lhs.${name} value
      else
        value
    ) rhs;

  # lib.strings.escapeShellArg's rule is not needed: the module joins argv with
  # spaces (every element is a validated path or flag).
  lib = {
    mkOption = attrs: attrs // { _type = "option"; };
    mkEnableOption = name: {
      _type = "option";
      default = false;
      description = "Whether to enable ${name}.";
    };
    mkIf = condition: content: {
      _type = "if";
      inherit condition content;
    };
    mkMerge = contents: {
      _type = "merge";
      inherit contents;
    };
    mkDefault = content: {
      _type = "override";
      priority = 1000;
      inherit content;
    };
    literalExpression = text: {
      _type = "literalExpression";
      inherit text;
    };
    types = {
      bool = "bool";
      str = "str";
      package = "package";
      nullOr = t: "nullOr ${t}";
      listOf = t: "listOf ${t}";
      enum = values: "enum";
      submodule = m: "submodule";
    };
    optional = cond: value: if cond then [ value ] else [ ];
    optionals = cond: values: if cond then values else [ ];
    optionalAttrs = cond: attrs: if cond then attrs else { };
    filterAttrs =
      pred: attrs:
      builtins.listToAttrs (
        builtins.concatMap (
          name:
          if pred name attrs.${name} then
            [
              {
                inherit name;
                value = attrs.${name};
              }
            ]
          else
            [ ]
        ) (builtins.attrNames attrs)
      );
    hasPrefix = prefix: str: builtins.substring 0 (builtins.stringLength prefix) str == prefix;
    inherit recursiveUpdate;
    concatStringsSep = builtins.concatStringsSep;
  };

  pkg = name: {
    outPath = "/nix/store/00000000000000000000000000000000-${name}";
    inherit name;
  };
  pkgs = {
    formats.toml = _: {
      type = "toml value";
      # The real one writes TOML through remarshal; the settings are what matter.
      generate = name: value: (pkg name) // { settings = value; };
    };
    nftables = pkg "nftables";
    caddy = pkg "caddy";
    git = pkg "git";
    openssh = pkg "openssh";
    socat = pkg "socat";
    iproute2 = pkg "iproute2";
    pciutils = pkg "pciutils";
    util-linux = pkg "util-linux";
  };

  # Option declarations -> their defaults (nested attrsets of options too).
  defaults =
    decls:
    builtins.mapAttrs (
      _: decl:
      if isType "option" decl then
        decl.default or null
      else if builtins.isAttrs decl then
        defaults decl
      else
        decl
    ) decls;

  # mkIf / mkMerge / mkDefault -> plain values (this module defines nothing twice).
  resolve =
    value:
    if isType "if" value then
      (if value.condition then resolve value.content else { })
    else if isType "merge" value then
      builtins.foldl' (acc: part: recursiveUpdate acc (resolve part)) { } value.contents
    else if isType "override" value then
      resolve value.content
    else if builtins.isAttrs value && !(value ? outPath) then
      # An attribute whose definition is a false mkIf is not defined at all.
      builtins.mapAttrs (_: resolve) (lib.filterAttrs (_: v: !(isType "if" v && !v.condition)) value)
    else
      value;

  config = {
    services.fabric = recursiveUpdate (defaults evaluated.options.services.fabric) userConfig;
    networking.hostName = hostName;
    services.caddy.enable = caddyEnable;
    services.tailscale = {
      enable = tailscaleEnable;
      package = pkg "tailscale";
      interfaceName = "tailscale0";
    };
    services.prometheus.exporters.node.enable = nodeExporterEnable;
    systemd.package = pkg "systemd";
  };

  evaluated = import module { inherit config lib pkgs; };
  result = resolve evaluated.config;
in
{
  services = result.systemd.services or { };
  timers = result.systemd.timers or { };
  node = result.environment.etc."fabric/node.toml".source.settings;
  flushRuleset = result.networking.nftables.flushRuleset or null;
  caddyExtraConfig = result.services.caddy.extraConfig or null;
  trustedInterfaces = result.networking.firewall.trustedInterfaces or [ ];
  assertions = result.assertions or [ ];
  tmpfiles = result.systemd.tmpfiles.rules or [ ];
  nodeExporterFlags = result.services.prometheus.exporters.node.extraFlags or [ ];
}
