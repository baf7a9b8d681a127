// A real HDFS for tests and benchmarks: Hadoop's MiniDFSCluster (one NameNode, two DataNodes, WebHDFS on)
// on loopback, run by pffs.testing.hdfs_cluster. Prints "READY <rpc port> <http port>" once it serves,
// then takes commands on stdin, one per line, answering "OK" or "ERROR <why>":
//   stop-datanode I     stops DataNode I (of those running); it can be started again
//   start-datanode      starts the DataNode stopped last
//   stop-namenode       stops the NameNode; start-namenode starts it again (same ports, same data)
//   make-files DIR N S  writes N files DIR/f00000 ... of S bytes each, file i holding the byte i % 251
//                       (in-process; empty files take ~1 ms each, a file with bytes ~30 ms)
//   quit                shuts everything down (so does the end of stdin)
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.ArrayDeque;
import java.util.Arrays;
import java.util.Deque;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.hdfs.HdfsConfiguration;
import org.apache.hadoop.hdfs.MiniDFSCluster;

public class PffsMiniDfs {
    public static void main(String[] args) throws Exception {
        String base = args[0];
        int rpcPort = Integer.parseInt(args[1]);
        int httpPort = Integer.parseInt(args[2]);
        Configuration conf = new HdfsConfiguration();
        conf.set(MiniDFSCluster.HDFS_MINIDFS_BASEDIR, base);
        conf.setBoolean("dfs.webhdfs.enabled", true);
        conf.setInt("dfs.replication", 2);
        MiniDFSCluster cluster = new MiniDFSCluster.Builder(conf)
                .numDataNodes(2)
                .nameNodePort(rpcPort)
                .nameNodeHttpPort(httpPort)
                .format(true)
                .build();
        cluster.waitActive();
        System.out.println("READY " + cluster.getNameNodePort() + " "
                + cluster.getNameNode().getHttpAddress().getPort());
        System.out.flush();
        Deque<MiniDFSCluster.DataNodeProperties> stopped = new ArrayDeque<>();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        String line;
        while ((line = in.readLine()) != null) {
            String[] words = line.trim().split("\\s+");
            try {
                if (words[0].equals("quit")) {
                    break;
                } else if (words[0].equals("stop-datanode")) {
                    stopped.push(cluster.stopDataNode(Integer.parseInt(words[1])));
                } else if (words[0].equals("start-datanode")) {
                    cluster.restartDataNode(stopped.pop(), true);
                    cluster.waitActive();
                } else if (words[0].equals("stop-namenode")) {
                    cluster.shutdownNameNode(0);
                } else if (words[0].equals("start-namenode")) {
                    cluster.restartNameNode(true);
                } else if (words[0].equals("make-files")) {
                    makeFiles(cluster.getFileSystem(), words[1], Integer.parseInt(words[2]),
                            Integer.parseInt(words[3]));
                } else {
                    throw new IllegalArgumentException("unknown command " + words[0]);
                }
                System.out.println("OK");
            } catch (Exception e) {
                System.out.println("ERROR " + e.toString().replace('\n', ' '));
            }
            System.out.flush();
        }
        cluster.shutdown(true);
    }

    private static void makeFiles(FileSystem fs, String dir, int count, int size) throws Exception {
        byte[] data = new byte[size];
        for (int i = 0; i < count; i++) {
            Arrays.fill(data, (byte) (i % 251));
            try (FSDataOutputStream out = fs.create(new Path(String.format("%s/f%05d", dir, i)))) {
                out.write(data);
            }
        }
    }
}
