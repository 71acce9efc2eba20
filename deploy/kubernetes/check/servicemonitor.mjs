import fs from 'fs';
import yaml from 'js-yaml';
import { ServiceMonitor } from '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1';
let bad = 0, seen = 0;
for (const file of process.argv.slice(2)) {
  for (const doc of yaml.loadAll(fs.readFileSync(file, 'utf8'))) {
    if (!doc || doc.kind !== 'ServiceMonitor') continue;
    seen++;
    try { new ServiceMonitor(doc).validate(); console.log(`INFO ${file} passed for servicemonitor/${doc.metadata.name} against its CRD schema`); }
    catch (e) { bad++; console.log(`ERROR ${file} servicemonitor/${doc.metadata.name}: ${e.message}`); }
  }
}
if (seen === 0) { console.log('no ServiceMonitor found'); process.exit(1); }
process.exit(bad ? 1 : 0);
