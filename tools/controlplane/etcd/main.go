// Command etcd runs a single-member etcd 3.6 for the test control plane.
//
// The project's tests need a real etcd behind a real kube-apiserver. No registry here ships
// an etcd binary of a version kube-apiserver 1.36 supports, but the Go module proxy ships
// etcd's server module, so this main embeds it (go.etcd.io/etcd/server/v3/embed) at the
// version kube-apiserver itself is built against. It listens on loopback only, keeps its
// data in --data-dir, and exits when it receives SIGTERM or SIGINT.
package main

import (
	"flag"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

func main() {
	dataDir := flag.String("data-dir", "", "directory for etcd's data (required)")
	clientURL := flag.String("listen-client-url", "http://127.0.0.1:2379", "client URL")
	peerURL := flag.String("listen-peer-url", "http://127.0.0.1:2380", "peer URL")
	flag.Parse()
	if *dataDir == "" {
		log.Fatal("etcd: --data-dir is required")
	}
	client, err := url.Parse(*clientURL)
	if err != nil {
		log.Fatalf("etcd: --listen-client-url: %v", err)
	}
	peer, err := url.Parse(*peerURL)
	if err != nil {
		log.Fatalf("etcd: --listen-peer-url: %v", err)
	}

	cfg := embed.NewConfig()
	cfg.Name = "rtrl-test"
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{*client}
	cfg.AdvertiseClientUrls = []url.URL{*client}
	cfg.ListenPeerUrls = []url.URL{*peer}
	cfg.AdvertisePeerUrls = []url.URL{*peer}
	cfg.InitialCluster = cfg.Name + "=" + peer.String()
	cfg.LogLevel = "warn"
	// A test cluster: small snapshots and no fsync-heavy defaults beyond etcd's own.
	cfg.SnapshotCount = 10000

	server, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("etcd: start: %v", err)
	}
	defer server.Close()
	select {
	case <-server.Server.ReadyNotify():
		log.Printf("etcd: ready on %s", client)
	case <-time.After(60 * time.Second):
		server.Server.Stop()
		log.Fatal("etcd: not ready after 60s")
	}

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	select {
	case err := <-server.Err():
		log.Fatalf("etcd: %v", err)
	case <-stop:
	}
}
