// Chaos faults of the broker itself: a three-node JetStream cluster that
// the chaos run starts on loopback (--nats-cluster with --nats-server),
// with the stream at three replicas, and the nemeses that Jepsen's analysis
// of NATS 2.12.1 used to make JetStream lose what it had acknowledged:
//
//	leader kill    SIGKILL the stream's leader; restart it a moment later
//	leader pause   SIGSTOP the leader past the election timeout (random,
//	               4 to 9 s): the others elect a new leader while the old
//	               one still believes it leads; then SIGCONT
//	truncation     SIGKILL a follower, truncate the stream's files in its
//	               data directory (message blocks and raft log) at random
//	               points, restart it: the disk lost what it had written
//	full restart   SIGKILL all three at once, start all three
//
// Each is followed by a wait until the stream has a leader and every
// replica is current again, so the next fault meets a healthy cluster.
// Nothing here is used outside the chaos run.

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// natsLeaderPause is how long the leader pause nemesis stops the leader:
// past nats-server's election timeout (random between 4 and 9 s), so that
// the followers elect a new leader while the old one is stopped.
const natsLeaderPause = 15 * time.Second

// natsClusterRecovery bounds the wait for a stream to have a leader and
// every replica current after a fault. A cluster that takes longer has not
// recovered, and the run says so.
const natsClusterRecovery = 90 * time.Second

// natsNemesis is one kind of cluster fault.
type natsNemesis string

const (
	natsLeaderKill  natsNemesis = "leader kill"
	natsLeaderStop  natsNemesis = "leader pause"
	natsTruncation  natsNemesis = "truncated restart"
	natsFullRestart natsNemesis = "full restart"
)

// natsNode is one nats-server process of a natsCluster.
type natsNode struct {
	name                                 string
	clientAddr, clusterAddr, monitorAddr string
	// dir is the node's JetStream store; it outlives the process.
	dir, config string
	binary      string
	log         io.Writer
	serverProcess
}

// natsCluster is the nats-server processes a chaos run started for itself
// on loopback: one, or three forming a JetStream cluster. The shared
// server is never touched.
type natsCluster struct {
	// name is the cluster's, its own among the clusters of every run on
	// the machine: a server of another run's cluster that reaches one of
	// its ports is refused, not joined.
	name  string
	nodes []*natsNode
	// syncAlways is set when the servers run with sync_interval: always
	// (nats-server 2.10 and later; 2.9 rejects the setting).
	syncAlways bool
	conn       *nats.Conn
	js         jetstream.JetStream
}

// natsStartAttempts is how often startNATSCluster starts a cluster on new
// ports when a server of the last attempt exited at start.
const natsStartAttempts = 3

// startNATSCluster starts size nats-servers from binary with JetStream,
// each storing under dir/<name>, with sync_interval: always if syncAlways
// and the binary knows the setting, and waits until a stream of size
// replicas can be created.
//
// Its ports are free when it picks them (freeLoopbackAddr), but another
// process may take one before the server binds it: a test beside this one
// restarting its own server on the port it had, say. The server then
// exits, and the cluster never has all its members; so a server that
// exits before the cluster is ready has the whole cluster started again,
// on new ports, in a new directory.
func startNATSCluster(ctx context.Context, binary, dir string, size int, syncAlways bool, log io.Writer) (*natsCluster, error) {
	for attempt := 1; ; attempt++ {
		cluster, err := tryNATSCluster(ctx, binary, filepath.Join(dir, fmt.Sprintf("start-%d", attempt)), size, syncAlways, log)
		if !errors.Is(err, errNATSNodeExited) || attempt == natsStartAttempts {
			return cluster, err
		}
		fmt.Fprintf(log, "%v; starting the cluster again on new ports\n", err)
	}
}

// natsPortPicker picks each port of a cluster's servers: freeLoopbackAddr,
// or in a test, a port it took first.
var natsPortPicker = freeLoopbackAddr

// errNATSNodeExited is a server of a cluster exiting before the cluster was
// ready.
var errNATSNodeExited = errors.New("a nats-server exited at start")

// natsClusters counts the clusters this process started, for their names.
var natsClusters atomic.Int64

// tryNATSCluster is one attempt of startNATSCluster, in dir.
func tryNATSCluster(ctx context.Context, binary, dir string, size int, syncAlways bool, log io.Writer) (*natsCluster, error) {
	cluster := &natsCluster{name: fmt.Sprintf("retrysafe-chaos-%d-%d", os.Getpid(), natsClusters.Add(1))}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	for i := range size {
		node := &natsNode{name: fmt.Sprintf("n%d", i+1), dir: filepath.Join(dir, fmt.Sprintf("n%d", i+1)), binary: binary, log: log}
		for _, addr := range []*string{&node.clientAddr, &node.clusterAddr, &node.monitorAddr} {
			var err error
			if *addr, err = natsPortPicker(); err != nil {
				return nil, err
			}
		}
		node.config = filepath.Join(dir, node.name+".conf")
		cluster.nodes = append(cluster.nodes, node)
	}
	if syncAlways {
		// nats-server 2.9 refuses a configuration that names
		// sync_interval; -t checks the file and exits.
		if err := cluster.writeConfigs(true); err != nil {
			return nil, err
		}
		syncAlways = exec.Command(binary, "-t", "-c", cluster.nodes[0].config).Run() == nil
	}
	cluster.syncAlways = syncAlways
	if err := cluster.writeConfigs(syncAlways); err != nil {
		return nil, err
	}
	for _, node := range cluster.nodes {
		if err := node.start(ctx); err != nil {
			cluster.stop()
			if node.exited() {
				err = fmt.Errorf("%w: %w", errNATSNodeExited, err)
			}
			return nil, err
		}
	}
	conn, err := nats.Connect(cluster.url(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond),
		nats.PingInterval(natsPingInterval), nats.MaxPingsOutstanding(natsMaxPingsOutstanding))
	if err != nil {
		cluster.stop()
		return nil, fmt.Errorf("connect to the run's NATS servers: %w", err)
	}
	cluster.conn = conn
	if cluster.js, err = jetstream.New(conn); err != nil {
		cluster.stop()
		return nil, err
	}
	// Ready means a stream of size replicas can be placed: a cluster
	// answers account requests as soon as it has a meta leader, and
	// refuses streams ("no suitable peers for placement") until that
	// leader knows every server.
	probe := jetstream.StreamConfig{Name: "RETRYSAFE_READY", Subjects: []string{"retrysafe-ready"}, Storage: jetstream.MemoryStorage, Replicas: size}
	for {
		probeCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := cluster.js.CreateOrUpdateStream(probeCtx, probe)
		if err == nil {
			err = cluster.js.DeleteStream(probeCtx, probe.Name)
		}
		cancel()
		if err == nil {
			return cluster, nil
		}
		// Its client port answered, but maybe another process's server
		// did, on a port this one could not bind.
		for _, node := range cluster.nodes {
			if node.exited() {
				cluster.stop()
				return nil, fmt.Errorf("%w: nats-server %s (see the process log)", errNATSNodeExited, node.name)
			}
		}
		select {
		case <-ctx.Done():
			cluster.stop()
			return nil, fmt.Errorf("JetStream on the run's NATS servers did not become ready: %w", err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// writeConfigs writes each node's configuration file.
func (c *natsCluster) writeConfigs(syncAlways bool) error {
	for _, node := range c.nodes {
		var config strings.Builder
		fmt.Fprintf(&config, "server_name: %s\nlisten: %s\nhttp: %s\n", node.name, node.clientAddr, node.monitorAddr)
		fmt.Fprintf(&config, "jetstream {\n  store_dir: %q\n", node.dir)
		if syncAlways {
			// Acknowledge a publish only once it is on disk.
			fmt.Fprintf(&config, "  sync_interval: always\n")
		}
		fmt.Fprintf(&config, "}\n")
		if len(c.nodes) > 1 {
			var routes []string
			for _, other := range c.nodes {
				if other != node {
					routes = append(routes, "nats-route://"+other.clusterAddr)
				}
			}
			fmt.Fprintf(&config, "cluster {\n  name: %s\n  listen: %s\n  routes: [%s]\n}\n", c.name, node.clusterAddr, strings.Join(routes, ", "))
		}
		if err := os.WriteFile(node.config, []byte(config.String()), 0o644); err != nil {
			return fmt.Errorf("write %s: %w", node.config, err)
		}
	}
	return nil
}

// url is every node's nats:// URL, separated by commas: what --broker
// takes.
func (c *natsCluster) url() string {
	var urls []string
	for _, node := range c.nodes {
		urls = append(urls, "nats://"+node.clientAddr)
	}
	return strings.Join(urls, ",")
}

// monitorURL is every node's HTTP monitoring URL, separated by commas:
// what --nats-monitor takes.
func (c *natsCluster) monitorURL() string {
	var urls []string
	for _, node := range c.nodes {
		urls = append(urls, "http://"+node.monitorAddr)
	}
	return strings.Join(urls, ",")
}

// stop shuts every node down and closes the run's connection.
func (c *natsCluster) stop() {
	if c.conn != nil {
		c.conn.Close()
	}
	for _, node := range c.nodes {
		node.stop()
	}
}

// start runs the node and waits until its client port accepts connections.
func (n *natsNode) start(ctx context.Context) error {
	cmd := exec.Command(n.binary, "-c", n.config)
	cmd.Stdout, cmd.Stderr = n.log, n.log
	return n.run(ctx, cmd, n.clientAddr, "nats-server "+n.name)
}

// streamCluster returns the stream's raft group, its leader and its
// followers, waiting (up to natsClusterRecovery) for it to have a leader.
func (c *natsCluster) streamCluster(ctx context.Context, stream string) (group string, leader *natsNode, followers []*natsNode, err error) {
	deadline := time.Now().Add(natsClusterRecovery)
	for {
		infoCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
		info, err := c.streamInfo(infoCtx, stream)
		cancel()
		if err == nil && info.Cluster != nil && info.Cluster.Leader != "" {
			for _, node := range c.nodes {
				if node.name == info.Cluster.Leader {
					leader = node
				} else {
					followers = append(followers, node)
				}
			}
			if leader == nil {
				return "", nil, nil, fmt.Errorf("stream %s: leader %q is not one of the run's servers", stream, info.Cluster.Leader)
			}
			return info.Cluster.RaftGroup, leader, followers, nil
		}
		if err == nil {
			err = errors.New("no leader")
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return "", nil, nil, fmt.Errorf("stream %s has no leader after %s: %w", stream, natsClusterRecovery, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// streamInfo asks for the stream's state.
func (c *natsCluster) streamInfo(ctx context.Context, stream string) (*jetstream.StreamInfo, error) {
	s, err := c.js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	return s.Info(ctx)
}

// waitRecovered waits until the stream has a leader and each of its other
// replicas is online and current, and returns how long that took.
func (c *natsCluster) waitRecovered(ctx context.Context, stream string) (time.Duration, error) {
	start := time.Now()
	var last string
	for {
		infoCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
		info, err := c.streamInfo(infoCtx, stream)
		cancel()
		switch {
		case err != nil:
			last = err.Error()
		case info.Cluster == nil || info.Cluster.Leader == "":
			last = "no leader"
		case len(info.Cluster.Replicas) != len(c.nodes)-1:
			last = fmt.Sprintf("%d replicas besides the leader", len(info.Cluster.Replicas))
		default:
			healthy := true
			for _, peer := range info.Cluster.Replicas {
				if peer.Offline || !peer.Current {
					healthy = false
					last = fmt.Sprintf("replica %s offline=%v current=%v lag=%d", peer.Name, peer.Offline, peer.Current, peer.Lag)
				}
			}
			if healthy {
				return time.Since(start), nil
			}
		}
		if time.Since(start) > natsClusterRecovery || ctx.Err() != nil {
			return time.Since(start), fmt.Errorf("stream %s did not recover in %s: %s", stream, natsClusterRecovery, last)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// natsClusterFaults counts the cluster nemeses a run injected.
type natsClusterFaults struct {
	LeaderKills, LeaderPauses, Truncations, FullRestarts int
	// BytesTruncated is what the truncations cut from the followers' files.
	BytesTruncated int64
	// LongestRecovery is the longest wait for the stream to have a leader
	// and every replica current again after a fault.
	LongestRecovery time.Duration
}

// inject runs one nemesis against the stream's cluster, then waits for
// the stream to recover. rng picks the truncation points.
func (c *natsCluster) inject(ctx context.Context, nemesis natsNemesis, stream string, rng *rand.Rand, counts *natsClusterFaults, mu *sync.Mutex) error {
	group, leader, followers, err := c.streamCluster(ctx, stream)
	if err != nil {
		return err
	}
	switch nemesis {
	case natsLeaderKill:
		leader.kill()
		time.Sleep(time.Duration(500+rng.IntN(1500)) * time.Millisecond)
		if err := leader.start(ctx); err != nil {
			return err
		}
	case natsLeaderStop:
		leader.pause(ctx, natsLeaderPause)
	case natsTruncation:
		if len(followers) == 0 {
			return fmt.Errorf("bug: truncation on a stream without followers")
		}
		victim := followers[rng.IntN(len(followers))]
		victim.kill()
		cut, err := truncateStreamFiles(victim.dir, stream, group, rng)
		if err != nil {
			return err
		}
		mu.Lock()
		counts.BytesTruncated += cut
		mu.Unlock()
		if err := victim.start(ctx); err != nil {
			return err
		}
	case natsFullRestart:
		for _, node := range c.nodes {
			node.kill()
		}
		for _, node := range c.nodes {
			if err := node.start(ctx); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("bug: unhandled NATS nemesis %q", nemesis)
	}
	took, err := c.waitRecovered(ctx, stream)
	mu.Lock()
	defer mu.Unlock()
	switch nemesis {
	case natsLeaderKill:
		counts.LeaderKills++
	case natsLeaderStop:
		counts.LeaderPauses++
	case natsTruncation:
		counts.Truncations++
	case natsFullRestart:
		counts.FullRestarts++
	}
	counts.LongestRecovery = max(counts.LongestRecovery, took)
	return err
}

// truncateStreamFiles truncates, at a random point, each file of a
// stopped node that holds the stream's messages (its message blocks) or
// its raft log (the blocks of its raft group), and returns how many bytes
// it cut. It stands for a disk that lost the tail of what the process
// wrote: more than an OS crash loses (which drops only what was not yet
// synced), less than Jepsen's bit flips.
func truncateStreamFiles(dir, stream, group string, rng *rand.Rand) (int64, error) {
	var cut int64
	err := filepath.WalkDir(dir, func(path string, entry fs.DirEntry, err error) error {
		if err != nil || entry.IsDir() || !strings.HasSuffix(path, ".blk") {
			return err
		}
		slashed := filepath.ToSlash(path)
		ours := strings.Contains(slashed, "/streams/"+stream+"/msgs/") || (group != "" && strings.Contains(slashed, "/"+group+"/msgs/"))
		if !ours {
			return nil
		}
		info, err := entry.Info()
		if err != nil || info.Size() == 0 {
			return err
		}
		keep := rng.Int64N(info.Size())
		if err := os.Truncate(path, keep); err != nil {
			return fmt.Errorf("truncate %s: %w", path, err)
		}
		cut += info.Size() - keep
		return nil
	})
	if err != nil {
		return cut, fmt.Errorf("truncate the stream's files under %s: %w", dir, err)
	}
	return cut, nil
}

// runNATSNemeses injects the cluster faults cfg asks for, in a random
// order, one at a time with a pause of a second or two before each, until
// all are done or ctx is.
func runNATSNemeses(ctx context.Context, cfg chaosConfig, cluster *natsCluster, stream string, counts *natsClusterFaults, mu *sync.Mutex) error {
	var schedule []natsNemesis
	for nemesis, n := range map[natsNemesis]int{natsLeaderKill: cfg.NATSLeaderKills, natsLeaderStop: cfg.NATSLeaderPauses,
		natsTruncation: cfg.NATSTruncations, natsFullRestart: cfg.NATSFullRestarts} {
		for range n {
			schedule = append(schedule, nemesis)
		}
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x4a75))
	// Map order is random; the seed alone must decide the order.
	slices.Sort(schedule)
	rng.Shuffle(len(schedule), func(i, j int) { schedule[i], schedule[j] = schedule[j], schedule[i] })
	for _, nemesis := range schedule {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Duration(1000+rng.IntN(1000)) * time.Millisecond):
		}
		if err := cluster.inject(ctx, nemesis, stream, rng, counts, mu); err != nil {
			return fmt.Errorf("%s: %w", nemesis, err)
		}
	}
	return nil
}
