// etcdload: a closed-loop load of etcd's own Go client (clientv3), the same against etcd
// and against ledgerkv's etcd API. Built by benchmarks/etcd_api.py with Debian's golang-go
// and golang-etcd-server-dev (GOPATH mode, nothing downloaded).
//
//	etcdload -endpoints 127.0.0.1:2379 -op put -clients 64 -conns 8 -seconds 10
//
// Prints one JSON line: {"op", "clients", "ops", "seconds", "ops_per_s", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms", "errors"}.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/clientv3"
)

func main() {
	endpoints := flag.String("endpoints", "127.0.0.1:2379", "comma-separated")
	op := flag.String("op", "put", "put | range (linearizable) | range-serializable | fill (put every key once, then stop)")
	clients := flag.Int("clients", 64, "concurrent requests in flight")
	conns := flag.Int("conns", 8, "gRPC connections they share")
	seconds := flag.Float64("seconds", 10, "how long")
	valueSize := flag.Int("value-size", 256, "bytes")
	keys := flag.Int("keys", 10000, "distinct keys")
	flag.Parse()

	eps := strings.Split(*endpoints, ",")
	cs := make([]*clientv3.Client, *conns)
	for i := range cs {
		c, err := clientv3.New(clientv3.Config{Endpoints: eps, DialTimeout: 5 * time.Second})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		defer c.Close()
		cs[i] = c
	}
	value := strings.Repeat("x", *valueSize)
	if *op == "fill" { // every key once, before a range load is measured
		var next int64 = -1
		var wg sync.WaitGroup
		failed := int32(0)
		for w := 0; w < *clients; w++ {
			wg.Add(1)
			go func(c *clientv3.Client) {
				defer wg.Done()
				for k := atomic.AddInt64(&next, 1); k < int64(*keys); k = atomic.AddInt64(&next, 1) {
					if _, err := c.Put(context.Background(), fmt.Sprintf("bench/%08d", k), value); err != nil {
						fmt.Fprintln(os.Stderr, err)
						atomic.StoreInt32(&failed, 1)
						return
					}
				}
			}(cs[w%len(cs)])
		}
		wg.Wait()
		if failed != 0 {
			os.Exit(1)
		}
		return
	}
	deadline := time.Now().Add(time.Duration(*seconds * float64(time.Second)))
	var mu sync.Mutex
	var lat []float64
	errors := 0
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < *clients; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			c := cs[w%len(cs)]
			var mine []float64
			bad := 0
			for n := 0; time.Now().Before(deadline); n++ {
				key := fmt.Sprintf("bench/%08d", (w*7919+n)%*keys)
				t0 := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				var err error
				switch *op {
				case "put":
					_, err = c.Put(ctx, key, value)
				case "range":
					_, err = c.Get(ctx, key)
				default:
					_, err = c.Get(ctx, key, clientv3.WithSerializable())
				}
				cancel()
				if err != nil {
					bad++
					continue
				}
				mine = append(mine, float64(time.Since(t0).Microseconds())/1000)
			}
			mu.Lock()
			lat = append(lat, mine...)
			errors += bad
			mu.Unlock()
		}(w)
	}
	wg.Wait()
	took := time.Since(start).Seconds()
	sort.Float64s(lat)
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return lat[int(p*float64(len(lat)-1))]
	}
	out, _ := json.Marshal(map[string]interface{}{
		"op": *op, "clients": *clients, "ops": len(lat), "seconds": took, "ops_per_s": float64(len(lat)) / took,
		"p50_ms": pct(0.5), "p90_ms": pct(0.9), "p99_ms": pct(0.99), "p999_ms": pct(0.999), "max_ms": pct(1), "errors": errors,
	})
	fmt.Println(string(out))
}
