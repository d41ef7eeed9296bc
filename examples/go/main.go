// Command onceflow-host is a host for `onceflow serve`, written with Go's standard library only.
//
// It connects to the server's Unix socket and
//
//   - registers as a host for session actions and code reviews (register_host), performs each call once
//     per call id (recorded in the -out journal, which a restarted host reads back) and answers it
//     (host_reply);
//   - subscribes to the event stream, logs every event (-events) and, after a reconnect or a restart,
//     resumes after the last event_seq it received;
//   - claims the runs of its agent profiles with a lease (claim_run), renews the lease while it works and
//     finishes each run with its claim token (renew_run, finish_run);
//   - reconnects on its own whenever a connection drops, and stops cleanly on SIGINT or SIGTERM.
//
// Usage:
//
//	onceflow-host -socket /tmp/board.sock -agents worker,reviewer -out host.jsonl -events events.jsonl
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"
)

// config is the command line.
type config struct {
	socket       string
	capabilities []string
	agents       []string
	out          string
	events       string
	lease        time.Duration
	wait         time.Duration
	work         time.Duration
	replyDelay   time.Duration
}

func parseFlags() (config, error) {
	var cfg config
	var capabilities, agents string
	flag.StringVar(&cfg.socket, "socket", "", "the Unix socket `onceflow serve --socket` listens on (required)")
	flag.StringVar(&capabilities, "capabilities", "session_action,code_review",
		"what to register for, comma-separated: session_action, code_review")
	flag.StringVar(&agents, "agents", "", "agent profiles to claim runs for, comma-separated (none: no runs)")
	flag.StringVar(&cfg.out, "out", "onceflow-host.jsonl",
		"the journal: one JSON line per action performed and run finished; read back at start")
	flag.StringVar(&cfg.events, "events", "", "append every event line here; resume after its last event_seq")
	flag.DurationVar(&cfg.lease, "lease", 30*time.Second, "the lease a claimed run gets, renewed every third of it")
	flag.DurationVar(&cfg.wait, "wait", 5*time.Second, "how long one claim_run waits for a run (at most 60s)")
	flag.DurationVar(&cfg.work, "work", 2*time.Second, "how long working one run takes")
	flag.DurationVar(&cfg.replyDelay, "reply-delay", 0,
		"wait this long between performing a call and answering it (to try a crash in between)")
	flag.Parse()
	cfg.capabilities = split(capabilities)
	cfg.agents = split(agents)
	switch {
	case cfg.socket == "":
		return cfg, fmt.Errorf("-socket is required")
	case flag.NArg() > 0:
		return cfg, fmt.Errorf("unexpected argument %q", flag.Arg(0))
	case len(cfg.capabilities) == 0:
		return cfg, fmt.Errorf("-capabilities names none")
	case cfg.lease < 3*time.Millisecond || cfg.lease > time.Hour:
		return cfg, fmt.Errorf("-lease must be in [3ms, 1h] (1h: the server's longest lease by default)")
	case cfg.wait <= 0 || cfg.wait > time.Minute:
		return cfg, fmt.Errorf("-wait must be in (0, 60s]")
	}
	for _, c := range cfg.capabilities {
		if c != "session_action" && c != "code_review" {
			return cfg, fmt.Errorf("-capabilities: this host cannot do %q", c)
		}
	}
	return cfg, nil
}

func split(list string) []string {
	var items []string
	for _, item := range strings.Split(list, ",") {
		if item = strings.TrimSpace(item); item != "" {
			items = append(items, item)
		}
	}
	return items
}

func main() {
	cfg, err := parseFlags()
	if err != nil {
		fmt.Fprintln(os.Stderr, "onceflow-host:", err)
		os.Exit(2)
	}
	journal, err := openJournal(cfg.out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "onceflow-host: -out:", err)
		os.Exit(1)
	}
	events, err := openEventLog(cfg.events)
	if err != nil {
		fmt.Fprintln(os.Stderr, "onceflow-host: -events:", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		<-ctx.Done()
		logf("info", "stopping")
		stop() // a second signal kills the process
	}()
	logf("info", "starting", "socket", cfg.socket, "agents", cfg.agents, "calls_done", len(journal.done),
		"resume_after", events.resumeAfter())

	var wg sync.WaitGroup
	start := func(run func(context.Context)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			run(ctx)
		}()
	}
	start((&host{cfg: cfg, journal: journal, events: events}).run)
	for _, agent := range cfg.agents {
		start((&worker{cfg: cfg, agent: agent, journal: journal}).run)
	}
	wg.Wait()
	logf("info", "stopped")
}

// backoff is the pause between reconnection attempts: 100ms, doubling up to 5s, back to 100ms once a
// connection works. failures counts the attempts since then, so a streak is logged once.
type backoff struct {
	delay    time.Duration
	failures int
}

func newBackoff() *backoff { return &backoff{delay: 100 * time.Millisecond} }

func (b *backoff) reset() { b.delay, b.failures = 100*time.Millisecond, 0 }

// sleep waits the current delay (or until ctx ends) and doubles the next one.
func (b *backoff) sleep(ctx context.Context) {
	b.failures++
	t := time.NewTimer(b.delay)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	if b.delay *= 2; b.delay > 5*time.Second {
		b.delay = 5 * time.Second
	}
}

var logMu sync.Mutex

// logf writes one JSON log line to stderr: time, level, msg and the key-value pairs kv.
func logf(level, msg string, kv ...any) {
	entry := map[string]any{"time": time.Now().UTC().Format(time.RFC3339Nano), "level": level, "msg": msg}
	for i := 0; i+1 < len(kv); i += 2 {
		entry[fmt.Sprint(kv[i])] = kv[i+1]
	}
	line, err := json.Marshal(entry)
	if err != nil {
		line = []byte(fmt.Sprintf(`{"level":"error","msg":"unloggable","error":%q}`, err.Error()))
	}
	logMu.Lock()
	defer logMu.Unlock()
	os.Stderr.Write(append(line, '\n'))
}
