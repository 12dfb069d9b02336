#!/bin/sh
# Start Alertmanager with ALERT_WEBHOOK_URL written into its config: Alertmanager reads no environment
# variables. Arguments are passed on to Alertmanager. The paths can be moved (the tests do) by
# ALERTMANAGER_TEMPLATE, ALERTMANAGER_CONFIG and ALERTMANAGER_BIN.
set -eu
: "${ALERT_WEBHOOK_URL:?set ALERT_WEBHOOK_URL to the URL that receives alert notifications}"
template=${ALERTMANAGER_TEMPLATE:-/etc/alertmanager/alertmanager.yml}
config=${ALERTMANAGER_CONFIG:-/alertmanager/alertmanager.rendered.yml}
url=$(printf '%s' "$ALERT_WEBHOOK_URL" | sed 's/[\\&|]/\\&/g')  # escape what sed's replacement would read
sed "s|\${ALERT_WEBHOOK_URL}|$url|g" "$template" > "$config"
exec "${ALERTMANAGER_BIN:-/bin/alertmanager}" --config.file="$config" "$@"
