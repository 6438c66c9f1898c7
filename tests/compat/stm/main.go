// stmcheck: etcd's software transactional memory (clientv3/concurrency.NewSTM), the Go
// client's recipe for multi-key transactions, under contention at each isolation level at
// once. Every transaction moves a third of one account into another and counts itself:
// the accounts' total never changes, and the count is the transactions that committed,
// plus at most those whose outcome the client could not learn (an error).
//
// Built by tests/test_etcd_stm.py with Debian's golang-go and golang-etcd-server-dev
// (GOPATH mode, nothing downloaded):
//
//	stmcheck -endpoints 127.0.0.1:2379 -workers 8 -each 50
//	stmcheck -endpoints 127.0.0.1:2379 -workers 6 -seconds 9   # for 9 s, however many that is
//
// Prints one JSON line: {level: {"total", "want_total", "count", "committed", "attempts", "errors"}}.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/clientv3"
	"go.etcd.io/etcd/clientv3/concurrency"
)

const accounts = 5
const opening = 1000

type result struct {
	Total     int      `json:"total"`
	WantTotal int      `json:"want_total"`
	Count     int      `json:"count"`
	Committed int      `json:"committed"`
	Attempts  int      `json:"attempts"`
	Errors    []string `json:"errors"`
}

func account(p string, i int) string { return fmt.Sprintf("%sacct/%d", p, i) }

func fail(err error) {
	fmt.Fprintln(os.Stderr, err)
	os.Exit(2)
}

func run(cli *clientv3.Client, p string, level concurrency.Isolation, workers, each int, until time.Time, seed int64) result {
	ctx, cancel := context.WithTimeout(context.Background(), 180*time.Second)
	defer cancel()
	for i := 0; i < accounts; i++ {
		if _, err := cli.Put(ctx, account(p, i), strconv.Itoa(opening)); err != nil {
			fail(err)
		}
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	r := result{WantTotal: accounts * opening, Errors: []string{}}
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(seed + int64(w)))
			for n := 0; n < each || time.Now().Before(until); n++ {
				from := rng.Intn(accounts)
				to := (from + 1 + rng.Intn(accounts-1)) % accounts
				_, err := concurrency.NewSTM(cli, func(s concurrency.STM) error {
					mu.Lock()
					r.Attempts++
					mu.Unlock()
					fv, _ := strconv.Atoi(s.Get(account(p, from)))
					tv, _ := strconv.Atoi(s.Get(account(p, to)))
					c, _ := strconv.Atoi(s.Get(p + "count"))
					s.Put(account(p, from), strconv.Itoa(fv-fv/3))
					s.Put(account(p, to), strconv.Itoa(tv+fv/3))
					s.Put(p+"count", strconv.Itoa(c+1))
					return nil
				}, concurrency.WithIsolation(level), concurrency.WithAbortContext(ctx))
				mu.Lock()
				if err != nil {
					r.Errors = append(r.Errors, err.Error())
				} else {
					r.Committed++
				}
				mu.Unlock()
			}
		}(w)
	}
	wg.Wait()
	for i := 0; i < accounts; i++ {
		g, err := cli.Get(ctx, account(p, i))
		if err != nil || len(g.Kvs) != 1 {
			fail(fmt.Errorf("reading %s back: %v", account(p, i), err))
		}
		v, _ := strconv.Atoi(string(g.Kvs[0].Value))
		r.Total += v
	}
	g, err := cli.Get(ctx, p+"count")
	if err != nil {
		fail(err)
	}
	if len(g.Kvs) == 1 {
		r.Count, _ = strconv.Atoi(string(g.Kvs[0].Value))
	}
	return r
}

func main() {
	endpoints := flag.String("endpoints", "127.0.0.1:2379", "comma-separated")
	workers := flag.Int("workers", 8, "concurrent transactions a level")
	each := flag.Int("each", 50, "transactions a worker (at least)")
	seconds := flag.Float64("seconds", 0, "go on until this long has passed (the transactions' count then varies)")
	prefix := flag.String("prefix", "stm/", "keys under")
	flag.Parse()
	cli, err := clientv3.New(clientv3.Config{Endpoints: strings.Split(*endpoints, ","), DialTimeout: 5 * time.Second})
	if err != nil {
		fail(err)
	}
	defer cli.Close()
	levels := map[string]concurrency.Isolation{
		"serializable-snapshot": concurrency.SerializableSnapshot,
		"serializable":          concurrency.Serializable,
		"repeatable-reads":      concurrency.RepeatableReads,
	}
	until := time.Now().Add(time.Duration(*seconds * float64(time.Second)))
	out := map[string]result{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	seed := int64(0)
	for name, level := range levels {
		wg.Add(1)
		seed += 1000
		go func(name string, level concurrency.Isolation, seed int64) {
			defer wg.Done()
			r := run(cli, *prefix+name+"/", level, *workers, *each, until, seed)
			mu.Lock()
			out[name] = r
			mu.Unlock()
		}(name, level, seed)
	}
	wg.Wait()
	b, _ := json.Marshal(out)
	fmt.Println(string(b))
}
