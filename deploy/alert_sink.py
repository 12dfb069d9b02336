"""A webhook receiver that prints every alert Alertmanager sends, one JSON line per alert.

The compose stack's default alert destination (`docker compose logs -f alert-sink`); set ALERT_WEBHOOK_URL
to send alerts to a real pager instead. Standard library only, so it runs in a plain Python image.
"""

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        try:
            notification = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            alerts = notification["alerts"]
        except (ValueError, KeyError, TypeError):
            self.send_error(400, "expected an Alertmanager webhook notification (JSON with 'alerts')")
            return
        for alert in alerts:
            labels, annotations = alert.get("labels", {}), alert.get("annotations", {})
            print(json.dumps({"status": alert.get("status"), "alertname": labels.get("alertname"),
                              "severity": labels.get("severity"), "summary": annotations.get("summary"),
                              "labels": labels, "startsAt": alert.get("startsAt"),
                              "receiver": notification.get("receiver")}), flush=True)
        self.send_response(200)
        self.end_headers()

    def do_GET(self):  # health check
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, format, *args):  # one line per alert is the output; no access log
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9095)
    args = parser.parse_args()
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
