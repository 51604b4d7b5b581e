# Leave a host's network as it was found: what `make compose-test` sources around the dockerd
# it starts (scripts/compose_test.sh).
#
# Why: dockerd writes its own iptables chains (DOCKER, DOCKER-USER, DOCKER-ISOLATION-*), sets
# the FORWARD policy to DROP and creates the docker0 bridge, and leaves all of it behind when it
# stops. Seen on a project machine after a compose test: Docker's chains and FORWARD DROP
# stayed. So, before dockerd starts, host_state_save records the IPv4 and IPv6 rules
# (iptables-save, ip6tables-save) and whether docker0 exists; after the daemon stopped,
# host_state_restore loads the rules back (iptables-restore replaces every table it is given:
# the saved ones, and an empty one for each table that appeared since) and deletes a docker0
# that was not there before. A tool that is not installed is noted and skipped.
#
# Usage (bash): source scripts/host_state.sh; host_state_save DIR; ...; host_state_restore DIR
# Messages go through `log` when the caller defines one. Tested with stand-in tools on PATH by
# tests/unit/test_host_state.py (nothing there touches this machine's firewall).

_host_state_log() {
    if declare -F log >/dev/null; then log "$*"; else printf '[host-state] %s\n' "$*"; fi
}

_host_state_families() {
    # "SAVE RESTORE FILE" for each address family.
    printf '%s\n' "iptables-save iptables-restore iptables.rules" \
        "ip6tables-save ip6tables-restore ip6tables.rules"
}

host_state_save() {
    # Record the firewall rules and whether docker0 exists into DIR (created; old records gone).
    local dir="$1" save restore file
    mkdir -p "${dir}"
    rm -f "${dir}"/*.rules "${dir}/docker0.absent"
    while read -r save restore file; do
        if ! command -v "${save}" >/dev/null; then
            _host_state_log "${save} is not installed: no ${file%.rules} rules to save or restore"
        elif "${save}" >"${dir}/${file}.tmp"; then
            mv "${dir}/${file}.tmp" "${dir}/${file}"
            _host_state_log "saved the ${file%.rules} rules ($(grep -c '^-A' "${dir}/${file}") rules) to ${dir}/${file}"
        else
            rm -f "${dir}/${file}.tmp"
            _host_state_log "${save} failed: the ${file%.rules} rules will not be restored"
        fi
    done < <(_host_state_families)
    if ! ip link show docker0 >/dev/null 2>&1; then
        : >"${dir}/docker0.absent"
    fi
    return 0
}

_host_state_new_tables() {
    # An empty table (built-in chains only, policy ACCEPT) for each table SAVE lists now that
    # the saved FILE does not: iptables-restore then empties it too.
    local save="$1" file="$2"
    "${save}" | awk -v saved="${file}" '
        BEGIN { while ((getline line < saved) > 0) if (line ~ /^\*/) had[line] = 1 }
        /^\*/ { table = had[$0] ? "" : $0; if (table != "") print table; next }
        table != "" && /^:/ && $2 != "-" { print $1, "ACCEPT", "[0:0]" }
        table != "" && /^COMMIT/ { print; table = "" }'
}

host_state_restore() {
    # Load the rules saved in DIR back, and delete docker0 when it was not there before.
    local dir="$1" save restore file added status=0
    while read -r save restore file; do
        [[ -f "${dir}/${file}" ]] || continue
        added=$(_host_state_new_tables "${save}" "${dir}/${file}") || added=""
        if { cat "${dir}/${file}"; [[ -z "${added}" ]] || printf '%s\n' "${added}"; } | "${restore}"; then
            _host_state_log "restored the ${file%.rules} rules from ${dir}/${file}"
        else
            _host_state_log "${restore} failed: check the host's ${file%.rules} rules by hand"
            status=1
        fi
    done < <(_host_state_families)
    if [[ -f "${dir}/docker0.absent" ]] && ip link show docker0 >/dev/null 2>&1; then
        if ip link delete docker0; then
            _host_state_log "deleted the docker0 bridge dockerd created"
        else
            _host_state_log "could not delete the docker0 bridge"
            status=1
        fi
    fi
    return "${status}"
}
